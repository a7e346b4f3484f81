"""`quantize --kv-bits 8`: a shared-cache fusion's cache in int8 per K/V head and channel.
Every GroupQueryAttention reads and writes it with the scales, the general form reads it
dequantized and writes it quantized; both stay within a quantization step of the float
cache; generate, validate and GenAI's folder take the int8 file."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.graph import metadata
from mha_onnx.graph.cache import cache_pairs
from mha_onnx.graph.walk import all_nodes, attr
from mha_onnx.rewrite.policy import FormPolicy
from tests.genai import genai_generate, needs_genai
from tests.paths import OPTIMUM

LOOSE = ("--min-top1", "0")  # random test models: near-tied logits make top-1 agreement noise


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def shared_llama(tmp_path_factory):
    from mha_onnx.generate.genai import deliver_genai
    from mha_onnx.rewrite import fuse_file

    out = tmp_path_factory.mktemp("kv") / "float" / "model.onnx"
    out.parent.mkdir()
    fuse_file(OPTIMUM / "llama" / "model.onnx", out, policy=FormPolicy(kv_cache="shared"))
    deliver_genai(out, OPTIMUM / "llama" / "model.onnx")  # (as `mha-onnx fuse` writes it)
    return out


def _bound_runs(path, feeds_list):
    """Runs of ``path`` on one buffer per cache bound as past and present (in place, as
    generate binds them); returns each run's logits and the buffers after the last."""
    from mha_onnx.generate import read_interface
    from mha_onnx.graph.cache import bound_step
    from mha_onnx.graph.files import read_model
    from mha_onnx.runtime.ort import OrtRunner

    proto = read_model(path, load_external_data=False)
    iface, pairs = read_interface(proto, path), cache_pairs(proto)
    import onnxruntime as ort

    arrays = {past: np.zeros((2, iface.kv_heads_of(past), 16, iface.head_of(past)),
                             iface.kv_dtype) for past in pairs}  # (alive: the buffers' memory)
    buffers = {past: ort.OrtValue.ortvalue_from_numpy(a) for past, a in arrays.items()}
    logits = []
    with OrtRunner(str(path)) as runner:
        for feeds in feeds_list:
            binding, run = bound_step(runner.session, {**feeds, **buffers}, buffers, pairs)
            run()
            logits.append(binding.get_outputs()[0].numpy())
        return logits, {p: a.copy() for p, a in arrays.items()}


def test_the_int8_cache_follows_the_float_cache_through_both_forms(shared_llama, tmp_path):
    """A left-padded two-row prompt (the general form) then one step (GroupQueryAttention),
    the scales calibrated on the float model's run of them: the first layer's cached
    positions within one step of their channel's scale of the float values (the general
    form rounds, within half a step; ORT's kernel wrote some positions a step off), every
    layer's cache and the logits close. Every GroupQueryAttention of every branch reads
    the int8 cache."""
    from mha_onnx.graph.files import read_model, write_model
    from mha_onnx.quantize import kv_cache

    mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 10], np.int64)
    ids = np.random.default_rng(0).integers(3, 100, (2, 10))
    prompt = {"input_ids": ids, "attention_mask": mask,
              "position_ids": np.maximum(mask.cumsum(1) - 1, 0),
              "past_sequence_length": np.array(0, np.int64)}
    step = {"input_ids": ids[:, :1], "attention_mask": np.ones((2, 11), np.int64),
            "position_ids": np.array([[7], [10]]), "past_sequence_length": np.array(10)}
    step["attention_mask"][0, :3] = 0
    want, float_cache = _bound_runs(shared_llama, [prompt, step])
    model = read_model(shared_llama)
    pairs = cache_pairs(model)
    scales = kv_cache.calibrate({pairs[p]: c for p, c in float_cache.items()}, pairs)
    kv_cache.quantize_cache(model, scales)
    (tmp_path / "q").mkdir()
    quant = write_model(model, tmp_path / "q" / "model.onnx", force=False)
    gqa = [n for n in all_nodes(model.graph) if n.op_type == "GroupQueryAttention"]
    assert gqa and all(attr(n, "kv_cache_bit_width") == 8 and len(n.input) == 14 for n in gqa)
    assert {v.type.tensor_type.elem_type for v in model.graph.input
            if v.name in pairs} == {onnx.TensorProto.INT8}
    got, int8_cache = _bound_runs(quant, [prompt, step])
    kept = (8, 11)  # each row's cached positions, kept first (the rows' layout)
    for past, scale in scales.items():
        for row, length in enumerate(kept):
            value = float_cache[past][row, :, :length]
            back = int8_cache[past][row, :, :length].astype(np.float32) * scale[0]
            if past.startswith("past_key_values.0."):  # (later layers read the int8 cache)
                assert np.all(np.abs(back - value) <= scale[0] * (1 + 1e-4)), past
            cosine = (back * value).sum() / np.linalg.norm(back) / np.linalg.norm(value)
            assert cosine > 0.999, past
    for w, g in zip(want, got, strict=True):
        cosine = (w * g).sum(-1) / np.linalg.norm(w, axis=-1) / np.linalg.norm(g, axis=-1)
        assert cosine[mask[:, -w.shape[1]:] != 0].min() > 0.999


def test_quantize_kv_bits_writes_an_int8_cache_generate_validate_and_genai_take(
        shared_llama, tmp_path):
    out = tmp_path / "q8" / "model.onnx"
    result = _cli("quantize", shared_llama, "-o", out, "--kv-bits", "8", *LOOSE,
                  "--no-sensitivity", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["config"]["kv_bits"] == 8
    assert any("KV cache in int8" in n for n in report["notes"])
    figures = report["accuracy"]
    assert figures["kl_mean"] is not None and figures["greedy"] is not None
    assert {e["output"] for e in figures["outputs"]} >= {"logits", "present.0.key"}
    assert min(e["cosine"] for e in figures["outputs"]) > 0.9  # presents compared as values
    model = onnx.load(out, load_external_data=False)
    assert metadata.loaded(model, "quantization")["kv_bits"] == 8
    from mha_onnx.generate import GenerationConfig, Generator

    with Generator(out) as generator:
        run = generator.generate([[5, 6, 7, 8, 9], [3, 4]], GenerationConfig(6, eos=()))
    assert [len(s) for s in run.sequences] == [6, 6]
    from tests.servers import alone, served  # the int8 cache in the serving engine's rows

    prompts = [[5, 6, 7, 8, 9], [3, 4], [9, 8, 7, 6, 5, 4, 3]]
    assert served(out, prompts, [6, 9, 4]) == alone(out, prompts, [6, 9, 4])
    config = json.loads((out.parent / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "model.genai.onnx"
    validated = _cli("validate", out, *LOOSE, "--reference", shared_llama)
    assert validated.exit_code == 0, validated.output


@needs_genai
def test_genais_generator_runs_the_int8_cache_as_generate_does(shared_llama, tmp_path):
    """ORT GenAI's generator (0.18, its ORT 1.32) on the int8-cache folder: each prompt's
    tokens are those `mha-onnx generate` makes with the file GenAI runs (its prompt through
    GroupQueryAttention too: the file as written runs a prompt through the general form,
    which rounds the cache where ORT's kernel lands a step off, and a random model's
    near-tied logits then pick other tokens)."""
    from mha_onnx.generate import GenerationConfig, Generator

    out = tmp_path / "g8" / "model.onnx"
    assert _cli("quantize", shared_llama, "-o", out, "--kv-bits", "8", *LOOSE,
                "--no-sensitivity").exit_code == 0
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    with Generator(out.parent / "model.genai.onnx") as generator:
        ours = [list(generator.generate([p], GenerationConfig(8, eos=())).sequences[0])
                for p in prompts]
    assert genai_generate(out.parent, prompts, 8, "each")["sequences"] == ours


def test_kv_calibration_prompts_set_the_scales(shared_llama, tmp_path):
    """--kv-calibration: each prompt's cache (its own run) sets the scales, not random ids;
    the report says which."""
    prompts = tmp_path / "calibration.json"
    prompts.write_text(json.dumps([[5, 9, 13, 2, 7, 40, 41], [8, 3]]))
    out = tmp_path / "c" / "model.onnx"
    result = _cli("quantize", shared_llama, "-o", out, "--kv-bits", "8", "--kv-calibration",
                  prompts, *LOOSE, "--no-sensitivity", "--json")
    assert result.exit_code == 0, result.output
    assert any("over 2 calibration prompt(s)" in n for n in json.loads(result.output)["notes"])
    prompts.write_text(json.dumps([[5, 9, 100000]]))
    bad = _cli("quantize", shared_llama, "-o", tmp_path / "b.onnx", "--kv-bits", "8",
               "--kv-calibration", prompts)
    assert bad.exit_code == 2 and "outside the vocabulary" in bad.output, bad.output


@pytest.mark.parametrize("args, message", [
    (("--kv-bits", "4"), "--kv-bits 4"),
    (("--kv-bits", "8"), "--kv-cache shared"),
    (("--kv-calibration", "p.json"), "--kv-bits 8"),
])
def test_bad_kv_bits_one_line_exit_2(tmp_path, args, message):
    result = _cli("quantize", OPTIMUM / "llama" / "model.onnx", "-o", tmp_path / "q.onnx",
                  *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_export_model_float16_with_an_int8_cache(hf_folder, tmp_path):
    """`export --model --dtype float16 --kv-cache shared --weights int4 --kv-bits 8`: the
    general form dequantizes into float16 (scales in both types), GroupQueryAttention takes
    its float32 scales; generate runs it, GenAI's folder names the file without Ifs, and,
    its float export gone, validate measures its logits against the folder's PyTorch
    model. --kv-bits without a shared cache: exit 2, before any export."""
    from mha_onnx.generate import GenerationConfig, Generator

    out = tmp_path / "model.onnx"
    result = _cli("export", "--model", hf_folder("llama"), "-o", out, "--dtype", "float16",
                  "--kv-cache", "shared", "--weights", "int4", "--kv-bits", "8")
    assert result.exit_code == 0, result.output
    assert "KV cache in int8" in result.output
    model = onnx.load(out, load_external_data=False)
    assert {v.type.tensor_type.elem_type for v in model.graph.input
            if v.name.startswith("past_key_values.")} == {onnx.TensorProto.INT8}
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert types["past_key_values.0.key_kv_scale"] == onnx.TensorProto.FLOAT
    assert types["past_key_values.0.key_kv_scale_t"] == onnx.TensorProto.FLOAT16
    with Generator(out) as generator:
        assert generator.interface.kv_dtype == "int8"
        run = generator.generate([[5, 6, 7, 8], [9, 10]], GenerationConfig(5, eos=()))
    assert [len(s) for s in run.sequences] == [5, 5]
    config = json.loads((out.parent / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "model.genai.onnx"
    checked = _cli("validate", out, *LOOSE, "--json")
    assert checked.exit_code == 0, checked.output
    refused = _cli("export", "--model", hf_folder("llama"), "-o", tmp_path / "a.onnx",
                   "--weights", "int4", "--kv-bits", "8")
    assert refused.exit_code == 2 and "--kv-cache shared" in refused.output


def test_profile_reads_each_models_own_cache_bytes(shared_llama, tmp_path):
    """profile --decode beside the float-cache file: the int8 file's step reads a quarter of
    the cache bytes (each model its own, in its cache's type: context x layers x K/V x
    kv heads x head size x itemsize)."""
    out = tmp_path / "p8" / "model.onnx"
    assert _cli("quantize", shared_llama, "-o", out, "--kv-bits", "8", *LOOSE,
                "--no-sensitivity").exit_code == 0
    result = _cli("profile", shared_llama, out, "--decode", "--context", "40", "--iters", "2",
                  "--warmup", "1", "--no-ops", "--json")
    assert result.exit_code == 0, result.output
    points = {p["model"]: p for p in json.loads(result.output[result.output.index("{"):])["points"]}
    model = onnx.load(shared_llama, load_external_data=False)
    dims = [next(v for v in model.graph.input if v.name == past).type.tensor_type.shape.dim
            for past in cache_pairs(model)]
    want = sum(40 * d[1].dim_value * d[3].dim_value * 4 for d in dims)
    assert points[str(shared_llama)]["cache_bytes"] == want
    assert points[str(out)]["cache_bytes"] == want // 4
