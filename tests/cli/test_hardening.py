"""Bad input, as a new user would type it: one line, a non-zero exit, no traceback, no output
left behind, nothing existing changed, no pickle executed. The table of what was tried and
what each got is docs/bad-inputs.md (regenerate: MHA_ONNX_UPDATE_DOCS=1 pytest -k bad_inputs)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from mha_onnx.cli import main
from mha_onnx.config import MhaConfig
from mha_onnx.errors import MhaOnnxError, ModelFileError
from mha_onnx.graph.files import atomic_path, read_model
from tests.export_memo import exporting_examples
from tests.paths import OPTIMUM, ROOT

DOC = ROOT / "docs" / "bad-inputs.md"
TINY = MhaConfig(d_model=16, num_heads=2, name="tiny", mask="key-padding")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/mha_onnx_pickle_ran",))


def _external_model(folder: Path, name: str, location: str) -> Path:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / f"{name}.onnx"  # not hash(location): salted per process, it can collide
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, export_cache, hf_folder):
    root = tmp_path_factory.mktemp("bad")
    good = root / "good.onnx"
    good.write_bytes(export_cache(TINY).read_bytes())
    f = {"good": good, "folder": root / "a_folder"}
    f["folder"].mkdir()
    f["empty"] = root / "empty.onnx"
    f["empty"].write_bytes(b"")
    f["json_file"] = root / "config.json"  # (onnx reads a .json path as JSON text)
    f["json_file"].write_text('{"architectures": ["LlamaForCausalLM"]}')
    f["garbage"] = root / "garbage.onnx"
    f["garbage"].write_bytes(b"this is not a protobuf \xff\xfe" * 40)
    data = good.read_bytes()
    f["truncated"] = root / "truncated.onnx"
    f["truncated"].write_bytes(data[: len(data) // 2])
    model = onnx.load(good)
    model.opset_import[0].version = 30
    f["opset30"] = root / "opset30.onnx"
    onnx.save(model, f["opset30"])
    model = onnx.load(good)
    model.ir_version = 14
    f["ir14"] = root / "ir14.onnx"
    onnx.save(model, f["ir14"])
    secret = root.parent / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    f["secret"] = secret
    f["ext_dotdot"] = _external_model(root, "ext_dotdot", "../secret.bin")
    f["ext_abs"] = _external_model(root, "ext_abs", str(secret))
    link = root / "link.bin"
    link.symlink_to(secret)
    f["ext_symlink"] = _external_model(root, "ext_symlink", "link.bin")
    f["bad_toml"] = root / "bad.toml"
    f["bad_toml"].write_text("d_model = 500\nnum_heads = 8\n")
    f["zero_toml"] = root / "zero.toml"
    f["zero_toml"].write_text("d_model = 0\nnum_heads = 8\n")
    wrong = MhaConfig(d_model=16, num_heads=2, d_v=4)
    from mha_onnx.reference.mha import build_reference

    torch.save(build_reference(wrong).state_dict(), root / "wrong_shape.pt")
    f["wrong_shape"] = root / "wrong_shape.pt"
    with (root / "evil.pt").open("wb") as handle:
        pickle.dump({"w_q.weight": _Evil()}, handle)
    f["evil"] = root / "evil.pt"
    f["exists"] = root / "exists.onnx"
    f["exists"].write_bytes(b"keep me")
    f["out"] = root / "out.onnx"
    relu = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    f["no_attention"] = root / "relu.onnx"
    onnx.save(relu, f["no_attention"])
    model = onnx.load(good)
    del model.metadata_props[:]
    f["no_metadata"] = root / "plain.onnx"
    onnx.save(model, f["no_metadata"])
    f["hf_llama"], f["hf_bert"] = hf_folder("llama"), hf_folder("bert")
    f["hf_truncated"] = root / "truncated_llama"
    shutil.copytree(f["hf_llama"], f["hf_truncated"])
    weights = f["hf_truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    optimum = OPTIMUM
    f["llama"], f["gpt2"] = optimum / "llama" / "model.onnx", optimum / "gpt2" / "model.onnx"
    f["genai"] = OPTIMUM.parent / "genai" / "llama-fp32" / "model.onnx"
    from mha_onnx.quantize.weights import QuantizeConfig, quantize_weights

    f["quantized"] = root / "quantized.onnx"
    onnx.save(quantize_weights(onnx.load(f["llama"]), QuantizeConfig()).model, f["quantized"])
    for name, prompts in (("p_empty", []), ("p_vocab", [[1, 500]]), ("p_ok", [[1, 2, 3]]),
                          ("p_long", [[5] * 250])):
        f[name] = root / f"{name}.json"
        f[name].write_text(json.dumps(prompts))
    return f


# (label, argv with {names}, expected exit code, text the message must hold)
CASES = [
    ("unknown preset", "export --preset huge -o {out}", 2, "unknown preset 'huge'"),
    ("d_model not divisible by heads", "export --config {bad_toml} -o {out}", 2, "not divisible"),
    ("zero d_model", "export --config {zero_toml} -o {out}", 2, "must be positive"),
    ("unknown dtype", "export --dtype bfloat16 -o {out}", 2, "'bfloat16' is not one of"),
    ("weights with a wrong shape", "export --config {tiny_toml} --weights {wrong_shape} -o {out}", 2,
     "'w_v.weight' has shape [8, 16], the config needs [16, 16]"),
    ("pickle that runs code", "export --config {tiny_toml} --weights {evil} -o {out}", 2,
     "refused to load"),
    ("missing weights file", "export --weights {folder}/none.pt -o {out}", 2, "weights file not found"),
    ("output exists", "export --config {tiny_toml} -o {exists}", 2, "output exists"),
    ("opset out of range", "export --opset 99 -o {out}", 2, "opset 99 is not supported"),
    ("missing model", "inspect {folder}/missing.onnx", 2, "model not found"),
    ("model path is a folder", "inspect {folder}", 2, "is a folder"),
    ("empty file", "inspect {empty}", 2, "is empty"),
    ("not ONNX bytes", "fuse {garbage} -o {out}", 2, "not a valid ONNX model"),
    ("a config.json given as the model", "inspect {json_file}", 2, "not a valid ONNX model"),
    ("truncated protobuf", "validate {truncated}", 2, "ONNX model"),
    ("opset newer than ORT", "fuse {opset30} -o {out}", 2, "uses opset 30"),
    ("IR version newer than ORT", "inspect {ir14}", 2, "IR version 14"),
    ("external data with ..", "inspect {ext_dotdot}", 2, "leaves the model's folder"),
    ("external data absolute", "fuse {ext_abs} -o {out}", 2, "absolute path"),
    ("external data via symlink", "validate {ext_symlink}", 2, "outside"),
    ("fuse output is a folder", "fuse {good} -o {folder}", 2, "output path is a folder"),
    ("fuse output exists", "fuse {good} -o {exists}", 2, "output exists"),
    ("validate without reference", "validate {no_metadata}", 2, "--reference"),
    ("malformed --shapes", "validate {good} --shapes 2:x", 2, "malformed shape '2:x'"),
    ("--shapes with a key length the model lacks", "validate {good} --shapes 1:4:5", 2,
     "has one sequence dim"),
    ("reference with other inputs", "validate {good} --reference {no_attention}", 2, "has inputs"),
    ("unknown provider", "validate {good} --providers cpu,tpu", 2, "unknown execution provider 'tpu'"),
    ("malformed --atol", "validate {good} --atol x=abc", 2, "malformed --atol"),
    ("malformed --seq-lens", "profile {good} --seq-lens 12,x", 2, "malformed --seq-lens"),
    ("shape too large for memory", "profile {good} --seq-lens 3000000", 2, "needs about"),
    ("validate shape too large for memory", "validate {good} --shapes 1:3000000", 2, "needs about"),
    ("generate: no prompts", "generate {llama} --prompts {p_empty}", 2, "no prompts"),
    ("serve: a folder without a model", "serve {folder}", 2, "holds 0 .onnx files"),
    ("serve: --max-batch 0", "serve {llama} --max-batch 0", 2, "--max-batch must be >= 1"),
    ("serve: --max-length past the position table", "serve {gpt2} --max-length 4096", 2,
     "past the model's 256 positions"),
    ("generate: ids outside the vocabulary", "generate {llama} --prompts {p_vocab}", 2,
     "outside the vocabulary"),
    ("generate: prompt and new tokens longer than the buffer",
     "generate {llama} --prompts {p_ok} --max-length 8 --max-new-tokens 8", 2,
     "more than --max-length 8"),
    ("generate: past a rotary model's context", "generate {llama} --prompts {p_long}", 2,
     "past the model's context of 256 positions"),
    ("generate: past the position table", "generate {gpt2} --prompts {p_long}", 2,
     "position table of 256"),
    ("generate: not a token decoder", "generate {good} --prompts {p_ok}", 2,
     "not a token decoder"),
    ("fuse: a graph neither ORT nor the reference evaluator runs (GenAI's builder graph)",
     "fuse {genai} -o {out}", 2, "cannot run the original model to verify against"),
    ("fuse --logits last without logits", "fuse {good} -o {out} --logits last", 2,
     "--logits last needs"),
    ("package a decoder for TensorRT", "package {llama} -o {folder}/repo --target tensorrt", 2,
     "onnxruntime backend only"),
    ("export --model: a folder without config.json", "export --model {folder} -o {out}", 2,
     "has no config.json"),
    ("export --model: truncated weights", "export --model {hf_truncated} -o {out}", 2,
     "cannot load"),
    ("export --model: a task the model cannot have",
     "export --model {hf_llama} --task image-feature-extraction -o {out}", 2, "does not fit"),
    ("export --model: a shared cache for an encoder",
     "export --model {hf_bert} --kv-cache shared -o {out}", 2, "is for decoders"),
    ("export --model: --logits last for an encoder",
     "export --model {hf_bert} --logits last -o {out}", 2, "is for decoders"),
    ("export --model with --preset", "export --model {hf_bert} --preset base -o {out}", 2,
     "--model excludes --preset"),
    ("quantize: an already quantized model", "quantize {quantized} -o {out}", 2,
     "already quantized"),
    ("quantize: no MatMul with a weight", "quantize {no_attention} -o {out}", 2,
     "no MatMul with a constant weight"),
    ("quantize: --block-size 7", "quantize {llama} -o {out} --block-size 7", 2,
     "a power of 2 >= 16"),
    ("export --model --weights int3", "export --model {hf_llama} --weights int3 -o {out}", 2,
     "int4, int8 or w8a8"),
    ("export --model --embeddings without --weights",
     "export --model {hf_llama} --embeddings int8 -o {out}", 2, "beside the weights"),
]


def _run(args: str, files: dict[str, Path]) -> tuple[int, str]:
    values = {k: str(v) for k, v in files.items()}
    argv = args.format(**values).split()
    result = CliRunner().invoke(main, argv, catch_exceptions=True, prog_name="mha-onnx")
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        f"{args} raised {result.exception!r}")
    return result.exit_code, result.output


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


@pytest.fixture
def bad_files(files, tmp_path):
    files = dict(files)
    files["tiny_toml"] = tmp_path / "tiny.toml"
    files["tiny_toml"].write_text("d_model = 16\nnum_heads = 2\n")
    return files


def _case_row(label: str, args: str, files: dict[str, Path]) -> tuple[int, list[str], str]:
    """(exit code, output lines, the docs row) of one bad-input case."""
    exit_code, output = _run(args, files)
    lines = [ln for ln in output.splitlines() if ln.strip()]
    message = lines[0] if lines else ""
    for name, path in files.items():
        message = message.replace(str(path), f"<{name}>")
    message = re.sub(r"/tmp/pytest-of-[^ ']*", "<tmp>", message)
    message = re.sub(r"[\d.]+ [KMG]?B is available", "<free memory> is available", message)
    return exit_code, lines, f"| {label} | `mha-onnx {args}` | {exit_code} | {message.replace('|', '/')} |"


@pytest.mark.parametrize("label, args, code, text", CASES, ids=[c[0] for c in CASES])
def test_bad_input(bad_files, label, args, code, text):
    """One line, the documented exit code, no traceback, no output file, nothing existing
    changed."""
    watched = {k: _digest(v) for k, v in bad_files.items() if isinstance(v, Path) and v.is_file()}
    exit_code, lines, _ = _case_row(label, args, bad_files)
    assert exit_code == code, (label, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), (label, lines)
    assert text in lines[0], (label, lines[0])
    assert not any("Traceback" in line for line in lines)
    assert not bad_files["out"].exists(), label
    assert {k: _digest(bad_files[k]) for k in watched} == watched
    assert not Path("/tmp/mha_onnx_pickle_ran").exists()


def test_bad_inputs_doc_is_current(bad_files):
    rows = [_case_row(label, args, bad_files)[2] for label, args, _, _ in CASES]
    table = "\n".join([
        "# Bad inputs and what mha-onnx says",
        "",
        "Generated by `tests/cli/test_hardening.py::test_bad_inputs_doc_is_current` (run with "
        "`MHA_ONNX_UPDATE_DOCS=1` to rewrite this file). Every case exits non-zero with one "
        "line, no traceback, leaves no output file and changes no existing file "
        "(`test_bad_input`, one test per case).",
        "",
        "| bad input | command | exit | message |",
        "|---|---|---|---|",
        *rows,
    ]) + "\n"
    if os.environ.get("MHA_ONNX_UPDATE_DOCS"):
        DOC.write_text(table)
    assert DOC.read_text() == table, "docs/bad-inputs.md is stale: MHA_ONNX_UPDATE_DOCS=1"


def test_no_attention_model_is_copied(files, tmp_path):
    out = tmp_path / "copy.onnx"
    result = CliRunner().invoke(main, ["fuse", str(files["no_attention"]), "-o", str(out)])
    assert result.exit_code == 0 and "unchanged copy" in result.output and out.exists()


def test_verbose_shows_the_traceback(files):
    result = CliRunner().invoke(main, ["-v", "inspect", str(files["garbage"])])
    assert result.exit_code == 2 and "Traceback" in result.output


def test_interrupt_mid_write_leaves_nothing(tmp_path, monkeypatch, files):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic_path(target, force=True) as tmp:
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.onnx"]

    import mha_onnx.rewrite.fuse as fuse

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fuse, "write_model", interrupted)
    out = tmp_path / "fused.onnx"
    result = CliRunner().invoke(main, ["fuse", str(files["good"]), "-o", str(out)])
    assert result.exit_code == 130 and "interrupted" in result.output and not out.exists()


def test_inputs_are_never_modified(files, tmp_path):
    good = files["good"]
    before = _digest(good)
    for argv in (["inspect", str(good)], ["fuse", str(good), "-o", str(tmp_path / "f.onnx")],
                 ["validate", str(good), "--shapes", "1:3"],
                 ["profile", str(good), "--seq-lens", "4", "--iters", "1", "--no-ops"]):
        assert CliRunner().invoke(main, argv).exit_code == 0, argv
    assert _digest(good) == before


# -- property tests -------------------------------------------------------------------------

configs = st.builds(
    lambda heads, dk, dv, per_head, attention, mask, bias: MhaConfig(
        d_model=heads * per_head, num_heads=heads, d_k=dk, d_v=dv, attention=attention,
        mask=mask, bias=bias, name="prop"),
    heads=st.integers(1, 4), dk=st.sampled_from([4, 8, 16]), dv=st.sampled_from([4, 8, 12]),
    per_head=st.sampled_from([4, 8]), attention=st.sampled_from(["self", "cross"]),
    mask=st.sampled_from(["none", "key-padding", "causal"]), bias=st.booleans(),
)


@pytest.mark.slow
@exporting_examples(6)  # (the same 6 every run: their exports are in the store)
@given(cfg=configs, seq=st.integers(1, 19), seq_kv=st.integers(1, 11), batch=st.integers(1, 3))
def test_export_fuse_validate_stays_at_parity(cfg, seq, seq_kv, batch, tmp_path_factory):
    from mha_onnx.export.mha import export_model
    from mha_onnx.graph.inputs import input_specs, parse_shapes
    from mha_onnx.parity import ValidateConfig, validate_model
    from mha_onnx.rewrite import fuse_file

    folder = tmp_path_factory.mktemp("prop")
    export_model(cfg, folder / "m.onnx")
    report = fuse_file(folder / "m.onnx", folder / "f.onnx")
    assert report.left == 0
    shape = f"{batch}:{seq}" + (f":{seq_kv}" if cfg.attention == "cross" else "")
    cases = tuple(parse_shapes(shape, input_specs(read_model(folder / "m.onnx"))))
    result = validate_model(folder / "f.onnx", ValidateConfig(shapes=cases, reference=str(folder / "m.onnx")))
    assert result, result.render()


@pytest.fixture(scope="module")
def small_bytes(export_cache):
    return export_cache(MhaConfig(d_model=8, num_heads=2, name="fuzz")).read_bytes()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_models_only_raise_our_errors(small_bytes, data, tmp_path_factory):
    from mha_onnx.parity import ValidateConfig, validate_model
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.inspect import inspect_model

    raw = bytearray(small_bytes)
    how = data.draw(st.sampled_from(["flip", "truncate", "splice"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    folder = tmp_path_factory.mktemp("fuzz")
    path, out = folder / "m.onnx", folder / "out.onnx"
    path.write_bytes(bytes(raw))
    for name, action in (("inspect", lambda: inspect_model(path)),
                         ("fuse", lambda: fuse_file(path, out)),
                         ("validate", lambda: validate_model(path, ValidateConfig(shapes=None)))):
        try:
            report = action()
        except MhaOnnxError as exc:  # anything else is a bug and fails the test
            assert exc.message and exc.exit_code in (1, 2, 3), name
            if name == "fuse":
                assert not out.exists(), "a failed fuse wrote its output"
        else:
            assert report.to_dict(), name
    assert path.read_bytes() == bytes(raw)  # the input is never modified


def test_read_model_rejects_dangling_inputs(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["nowhere"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (tmp_path / "d.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ModelFileError, match="not a valid ONNX model"):
        read_model(tmp_path / "d.onnx")


@pytest.mark.parametrize("mask", ["key-padding", "causal", "none"])
def test_float16_has_no_nan_where_float32_has_none(export_cache, mask, tmp_path):
    from mha_onnx.graph.inputs import ShapeCase, contract_specs, make_inputs
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.runtime.ort import OrtRunner

    cfg = MhaConfig(d_model=64, num_heads=4, mask=mask, dtype="float16", name="h")
    src = export_cache(cfg)
    fuse_file(src, tmp_path / "f.onnx")
    feeds = make_inputs(contract_specs(cfg), ShapeCase("x", {"batch": 2, "seq_q": 300, "seq_kv": 300}))
    feeds["query"] = (feeds["query"].astype(np.float32) * 4).astype(np.float16)  # large scores
    for path in (src, tmp_path / "f.onnx"):
        out = OrtRunner(str(path)).infer(feeds)["output"]
        assert np.isfinite(out).all(), path


@pytest.mark.parametrize("key, damage", [
    ("params", lambda text: text[:len(text) // 2]),                      # not JSON
    ("params", lambda text: text.replace('"transposed"', '"flipped"')),  # an entry's key gone
    ("params", lambda text: "[1, 2]"),                                   # not an object
    ("config", lambda text: text.replace("}", ', "heads": 3}')),         # unknown key
])
def test_damaged_metadata_is_one_error_not_a_crash(small_bytes, tmp_path, key, damage):
    """Found by the fuzz test: the PyTorch reference is rebuilt from the metadata, whose
    damage must read as ModelFileError/ConfigError (exit 2), not a JSONDecodeError."""
    from mha_onnx.graph import metadata
    from mha_onnx.parity import ValidateConfig, validate_model

    model = onnx.load_from_string(small_bytes)
    metadata.write(model, {key: damage(metadata.read(model)[key])})
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(MhaOnnxError) as caught:
        validate_model(path, ValidateConfig(shapes=None))
    assert caught.value.exit_code == 2 and caught.value.message


def test_dim_expressions_are_integer_arithmetic_and_nothing_else():
    """A KV-cache total (past_seq + seq_q), torch's symbolic leftovers ((seq**2)//seq); any
    other text (calls, attributes, huge powers, division by zero) has no value."""
    from mha_onnx.graph.expressions import evaluate as resolve_dim

    values = {"seq": 7, "past_seq": 3, "seq_q": 2}
    assert resolve_dim("past_seq + seq_q", values) == 5
    assert resolve_dim("((seq**2)//seq)", values) == 7
    assert resolve_dim("2*seq - 1", values) == 13 and resolve_dim(4, values) == 4
    for text in ("__import__('os')", "seq.real", "2**4096", "seq // (seq - 7)", "unknown + 1",
                 "seq +", "1.5"):
        assert resolve_dim(text, values) is None, text
