"""`mha-onnx quantize`: ONNX Runtime's quantizer reaching every MatMul of a fused model (If
branches, a packed weight two branches share: quantized once), the fused forms, interface
and metadata kept; the accuracy report's figures, a broken quantization flagged; validate
of a quantized model against its float original and across runtimes; export --model
--weights."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.generate import GenerationConfig, Generator
from mha_onnx.rewrite.policy import FormPolicy
from tests.paths import OPTIMUM

FIXTURES = OPTIMUM
LOOSE = ("--min-top1", "0")  # random test models: near-tied logits make top-1 agreement noise


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _nodes(model: onnx.ModelProto):
    from mha_onnx.graph.walk import all_nodes

    return list(all_nodes(model.graph))


def _float_matmuls_with_weights(model: onnx.ModelProto) -> list[str]:
    """MatMuls whose weight is an initializer of their graph or one above."""
    found = []

    def walk(graph, names):
        names = names | {t.name for t in graph.initializer}
        for node in graph.node:
            if node.op_type == "MatMul" and node.input[1] in names:
                found.append(node.name)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g, names)

    walk(model.graph, set())
    return found


@pytest.fixture(scope="module")
def fused_llama(tmp_path_factory):
    """The Optimum Llama fixture fused in both forms, each in a folder of its own (with
    GenAI's folder, as `mha-onnx fuse` writes it)."""
    from mha_onnx.generate.genai import deliver_genai
    from mha_onnx.rewrite import fuse_file

    root = tmp_path_factory.mktemp("fused")
    made = {}
    for form in ("appended", "shared"):
        out = root / form / "model.onnx"
        out.parent.mkdir()
        fuse_file(FIXTURES / "llama" / "model.onnx", out, policy=FormPolicy(kv_cache=form))
        deliver_genai(out, FIXTURES / "llama" / "model.onnx")  # (as `mha-onnx fuse` does)
        made[form] = out
    return made


@pytest.mark.parametrize("form", ["appended", "shared"])
@pytest.mark.models
def test_every_matmul_of_a_fused_model_is_quantized_and_the_model_kept(fused_llama, tmp_path,
                                                                        form):
    source = fused_llama[form]
    out = tmp_path / "q" / "model.onnx"
    result = _cli("quantize", source, "-o", out, *LOOSE, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    before, after = onnx.load(source), onnx.load(out)
    assert not _float_matmuls_with_weights(after)
    packed = [n for n in _nodes(before) if n.op_type == "MatMul" and "packed" in n.name]
    assert len(packed) == 4  # two layers' packed Q/K/V, each read by two If branches
    quantized = [n for n in _nodes(after) if n.op_type == "MatMulNBits"]
    assert len(quantized) == len(_float_matmuls_with_weights(before)) == 13
    names = [t.name for graph in [after.graph] for t in graph.initializer]
    assert len([n for n in names if n.endswith("_Q4")]) == 11  # a shared weight stored once
    attrs = {a.name: a.i for a in quantized[0].attribute}
    assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, 32, 4)
    for attr in ("input", "output"):
        assert [(v.name, v.type) for v in getattr(before.graph, attr)] == \
            [(v.name, v.type) for v in getattr(after.graph, attr)]
    kept = {p.key: p.value for p in after.metadata_props}
    for key in ("mha_onnx.kv_cache", "mha_onnx.fusion", "mha_onnx.generation"):
        assert kept[key] == {p.key: p.value for p in before.metadata_props}[key]
    assert report["bytes"]["quantized"] < 0.8 * report["bytes"]["float"]
    genai = json.loads((out.parent / "genai_config.json").read_text())["model"]["decoder"]
    # a shared cache's quantized file gets its own file for GenAI (generate/genai_file.py)
    assert genai["filename"] == (out.name if form == "appended"
                                 else out.name.replace(".onnx", ".genai.onnx"))
    with Generator(out) as generator:  # the same loop runs it, the cache form kept
        assert generator.interface.form == form
        rows = generator.generate([[5, 6, 7]], GenerationConfig(8, eos=())).sequences
    assert len(rows[0]) == 8
    # validate finds the float model quantize recorded, and judges the accuracy
    checked = _cli("validate", out, *LOOSE, "--json")
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.output)["accuracy"]["kl_mean"] is not None


@pytest.mark.models
def test_exclude_and_mixed_set_each_matmuls_bits(fused_llama, tmp_path):
    out = tmp_path / "model.onnx"
    result = _cli("quantize", fused_llama["shared"], "-o", out, "--exclude", "*lm_head*",
                  "--mixed", "*mlp*", *LOOSE, "--no-sensitivity", "--json")
    assert result.exit_code == 0, result.output
    bits = json.loads(result.output)["matmuls"]
    assert bits["/lm_head/MatMul"] == 0
    assert {b for n, b in bits.items() if "/mlp/" in n} == {8}
    assert {b for n, b in bits.items() if "self_attn" in n} == {4}
    model = onnx.load(out)
    assert _float_matmuls_with_weights(model) == ["/lm_head/MatMul"]
    attrs = {n.name: {a.name: a.i for a in n.attribute} for n in _nodes(model)
             if n.op_type == "MatMulNBits"}
    assert {a["bits"] for n, a in attrs.items() if "mlp" in n} == {8}


def _outlier_llama(folder: Path) -> Path:
    """A small Llama whose weights have one outlier input channel each, as trained LLMs
    have them: 4-bit blocks of 32 keep the rest of each column's precision, one block over
    the whole column does not."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=99, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.015, eos_token_id=98))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.ndim == 2 and "embed" not in name:
                weight[:, torch.randperm(weight.shape[1])[:1]] *= 24
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_the_report_has_its_figures_and_a_broken_quantization_is_flagged(tmp_path):
    """Default int4 (block 32, symmetric) passes the same thresholds that block 256
    asymmetric fails: exit 1, the figures and the failures said, nothing written."""
    folder = _outlier_llama(tmp_path / "hf")
    source = tmp_path / "float" / "model.onnx"
    assert _cli("export", "--model", folder, "-o", source).exit_code == 0
    thresholds = ("--min-top1", "0", "--min-cosine", "0.8", "--max-kl", "0.05")
    good = _cli("quantize", source, "-o", tmp_path / "good.onnx", *thresholds, "--json")
    assert good.exit_code == 0, good.output
    figures = json.loads(good.output)["accuracy"]
    for key in ("kl_mean", "kl_max", "top1", "greedy", "positions"):
        assert figures[key] is not None, key
    assert figures["positions"] == 256 and figures["passed"]
    assert {o["output"] for o in figures["outputs"]} >= {"logits", "present.0.key"}
    assert len(figures["sensitivity"]) == 11  # one per weight (packed Q/K/V: one)
    assert figures["sensitivity"][0]["kl"] > figures["sensitivity"][-1]["kl"] > 0
    broken = _cli("quantize", source, "-o", tmp_path / "broken.onnx", "--block-size", "256",
                  "--asymmetric", "--no-sensitivity", *thresholds)
    assert broken.exit_code == 1, broken.output
    assert "FAIL logits KL" in broken.output and "FAIL logits: cosine" in broken.output
    assert "nothing was written" in broken.output and not (tmp_path / "broken.onnx").exists()


@pytest.mark.models
def test_validate_across_runtimes(tmp_path, fused_llama):
    """A quantized export runs on OpenVINO as on ORT's CPU; a model fused for ORT's
    kernels is refused there with the reason (exit 3)."""
    plain = tmp_path / "plain.onnx"
    assert _cli("quantize", FIXTURES / "llama" / "model.onnx", "-o", plain, *LOOSE,
                "--no-sensitivity").exit_code == 0
    result = _cli("validate", plain, *LOOSE, "--providers", "cpu,openvino", "--json")
    assert result.exit_code == 0, result.output
    (runtime,) = json.loads(result.output)["runtimes"]
    assert runtime["ran"] and runtime["passed"]
    # no thresholds given: those it was quantized with (--min-top1 0), not the defaults;
    # one given: that one over them
    recorded = _cli("validate", plain, "--json")
    assert recorded.exit_code == 0, recorded.output
    used = json.loads(recorded.output)["accuracy"]["thresholds"]
    assert used["min_top1"] == 0 and used["max_kl"] == 0.05
    stricter = json.loads(_cli("validate", plain, "--max-kl", "0.01", "--json").output)
    assert stricter["accuracy"]["thresholds"] == {**used, "max_kl": 0.01}
    fused = tmp_path / "fused.onnx"
    assert _cli("quantize", fused_llama["shared"], "-o", fused, *LOOSE,
                "--no-sensitivity").exit_code == 0
    refused = _cli("validate", fused, *LOOSE, "--providers", "cpu,openvino")
    assert refused.exit_code == 3 and "not supported by openvino" in refused.output
    moved = _cli("validate", fused, *LOOSE, "--reference", fused_llama["shared"])
    assert moved.exit_code == 0 and "against the float model" in moved.output


@pytest.mark.slow
def test_export_model_with_int8_weights(hf_folder, tmp_path):
    out = tmp_path / "model.onnx"
    result = _cli("export", "--model", hf_folder("llama"), "-o", out, "--weights", "int8")
    assert result.exit_code == 0, result.output
    assert "weights in int8" in result.output
    model = onnx.load(out)
    assert not _float_matmuls_with_weights(model)
    assert {a.i for n in _nodes(model) if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "bits"} == {8}
    with Generator(out) as generator:
        assert len(generator.generate([[3, 4]], GenerationConfig(4, eos=())).sequences[0]) == 4
    # its float export is gone with the export's temporary folder: validate measures it
    # against the folder's PyTorch model
    checked = _cli("validate", out, "--json")
    assert checked.exit_code == 0, checked.output
    report = json.loads(checked.output[checked.output.index("{"):])  # (after transformers'
    # loading bar)
    assert report["reference"].startswith("PyTorch") and report["accuracy"]["top1"] > 0.9


@pytest.mark.slow
def test_export_quantizes_as_quantize_does_gptq_blocks_and_mixed(hf_folder, tmp_path):
    """export --model --weights takes quantize's --algorithm, --calibration, --block-size
    and --mixed: the file records them and its LM head is the int8 one asked for."""
    from mha_onnx.graph import metadata

    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps([[3 + (i * 7 + j) % 50 for j in range(40)]
                                       for i in range(4)]))
    out = tmp_path / "model.onnx"
    result = _cli("export", "--model", hf_folder("llama"), "-o", out, "--weights", "int4",
                  "--algorithm", "gptq", "--calibration", calibration, "--block-size", "64",
                  "--mixed", "*lm_head*")
    assert result.exit_code == 0, result.output
    model = onnx.load(out)
    record = metadata.loaded(model, "quantization")
    assert (record["algorithm"], record["block_size"], record["int8"]) == \
        ("gptq", 64, ["*lm_head*"])
    bits = {n.input[1]: next(a.i for a in n.attribute if a.name == "bits")
            for n in _nodes(model) if n.op_type == "MatMulNBits"}  # (by weight)
    assert sorted(bits.values()).count(8) == 1 and set(bits.values()) == {4, 8}, bits
    assert not _float_matmuls_with_weights(model)


def test_export_refuses_quantizing_options_before_it_exports(tmp_path):
    folder = str(tmp_path)  # (never read: the options are refused first)
    for args, said in ((("--block-size", "64"), "--block-size is for the weights quantized"),
                       (("--weights", "int4", "--algorithm", "gptq"), "--calibration"),
                       (("--weights", "int8", "--algorithm", "hqq"), "HQQ quantizes to 4")):
        result = _cli("export", "--model", folder, "-o", tmp_path / "m.onnx", *args)
        assert result.exit_code == 2 and said in result.output, result.output


@pytest.mark.slow
def test_an_export_whose_quantized_model_fails_the_gate_keeps_the_float_model(
        hf_folder, tmp_path, monkeypatch):
    """The gate refuses the int4 model (thresholds no model meets): exit 1, the int4 model
    not written, the float export (the expensive, validated work) kept beside it and named."""
    import functools

    import mha_onnx.quantize.run as run
    from mha_onnx.quantize.accuracy import Thresholds

    monkeypatch.setattr(run, "quantize_file", functools.partial(
        run.quantize_file, thresholds=Thresholds(max_kl=1e-12, min_top1=1.0, min_cosine=1.0)))
    out = tmp_path / "model.onnx"
    result = _cli("export", "--model", hf_folder("llama"), "-o", out, "--weights", "int4")
    assert result.exit_code == 1, result.output
    kept = tmp_path / "model.float.onnx"
    assert not out.exists() and kept.exists()
    assert "past the accuracy thresholds" in result.output and str(kept) in result.output
    assert not [n for n in _nodes(onnx.load(kept)) if n.op_type == "MatMulNBits"]


def test_matmuls_inside_if_branches_are_quantized_and_a_weight_they_share_stored_once():
    """Each branch multiplies by one weight of the main graph (differently: nothing to
    hoist); both become MatMulNBits reading one quantized copy, and each branch gives
    what its float form gives, within int4's error."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from mha_onnx.quantize.weights import QuantizeConfig, quantize_weights
    from mha_onnx.runtime.ort import OrtRunner

    weight = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32), "w")
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    then = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "t", [], out)
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["n"]),
                               helper.make_node("MatMul", ["n", "w"], ["y"])], "e", [], out)
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["out"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 48])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    quantized = quantize_weights(model, QuantizeConfig()).model
    assert [n.op_type for n in _nodes(quantized) if "MatMul" in n.op_type] == ["MatMulNBits"] * 2
    names = [t.name for t in quantized.graph.initializer]
    assert len([n for n in names if n.endswith("_Q4")]) == 1 and "w" not in names
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        want = OrtRunner(model.SerializeToString(), "cpu").infer(feeds)["out"]
        got = OrtRunner(quantized.SerializeToString(), "cpu").infer(feeds)["out"]
        assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_a_pattern_that_names_no_matmul_is_said():
    """--mixed and --exclude patterns match node, weight and module names; one that
    matches none (a typo, or torch.export's val_82 names) is said, not silently dropped."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from mha_onnx.quantize.weights import QuantizeConfig, quantize_weights

    weight = numpy_helper.from_array(np.ones((64, 32), np.float32), "val_82")
    node = helper.make_node("MatMul", ["x", "val_82"], ["y"], name="node_MatMul_7")
    node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value="['', 'lm_head']")
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
                              [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    made = quantize_weights(model, QuantizeConfig(int8=("*lm_head*", "*lm_haed*")))
    assert list(made.matmuls().values()) == [8]  # (its module named it)
    said = [n for n in made.notes if "names no MatMul" in n]
    assert len(said) == 1 and "'*lm_haed*'" in said[0]
