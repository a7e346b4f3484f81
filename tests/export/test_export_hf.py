"""`export --model DIR`: Hugging Face folders written by the pinned transformers from small
random configs (nothing downloaded) -> fused, validated ONNX with Optimum's interface, and
`validate OUT.onnx` rebuilding the PyTorch reference from the folder."""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.parity import ValidateConfig, validate_model


def _export(folder, out, *extra):
    result = CliRunner().invoke(main, ["export", "--model", str(folder), "-o", str(out), "--json",
                                       *extra])
    assert "Loading weights" not in result.output  # (transformers' bars leaked into stderr)
    return result


def _ops(model: onnx.ModelProto) -> set[str]:
    from mha_onnx.graph.walk import all_nodes

    return {n.op_type for n in all_nodes(model.graph)}


@pytest.mark.parametrize("name", ["llama", "qwen3", "helium"])
def test_decoders_export_fused_on_gqa_with_optimums_interface(hf_folder, tmp_path, name):
    out = tmp_path / f"{name}.onnx"
    result = _export(hf_folder(name), out)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["task"] == "text-generation-with-past"
    assert any(c["case"].startswith("decode step 16") for c in report["validation"]["comparisons"])
    model = onnx.load(out)
    inputs = [i.name for i in model.graph.input]
    assert inputs == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                      "past_key_values.0.value", "past_key_values.1.key",
                      "past_key_values.1.value"]
    assert [o.name for o in model.graph.output] == ["logits", "present.0.key", "present.0.value",
                                                    "present.1.key", "present.1.value"]
    mask = [d.dim_param for d in model.graph.input[1].type.tensor_type.shape.dim]
    assert mask == ["batch", "past_sequence_length + sequence_length"]
    assert "GroupQueryAttention" in _ops(model)
    if name != "llama":  # the family's own numbers are checked by the export's validation
        return
    # validate rebuilds the PyTorch reference from the folder: no --reference
    again = validate_model(out, ValidateConfig())
    assert again, again.render()
    assert any(c.case.startswith("decode step") for c in again.comparisons)
    assert [c.passed for c in again.checks if c.name == "weights"] == [True]


def test_sinks_and_a_cache_shaped_per_layer(hf_folder, tmp_path):
    """MiMo-V2-Flash (issue 42, class 2): its sliding-window layers cache all four heads and
    carry sinks, its full-attention layers cache two (the config's num_key_value_heads was
    taken for every layer: torch.export failed on the cache's Concat); its experts routed
    (transformers' grouped_mm is a custom op torch.export cannot lower: batched_mm)."""
    out = tmp_path / "mimo.onnx"
    result = _export(hf_folder("mimo"), out)
    assert result.exit_code == 0, result.output
    model = onnx.load(out)
    heads = [i.type.tensor_type.shape.dim[1].dim_value for i in model.graph.input[3:]]
    assert heads == [4, 4, 2, 2]
    from mha_onnx.graph.walk import all_nodes

    sinks = [n for n in all_nodes(model.graph) if n.op_type == "GroupQueryAttention"
             and len(n.input) > 11 and n.input[11]]
    assert sinks  # head_sink on ORT's kernel
    report = json.loads(result.output[result.output.index("{"):])
    assert any(c["case"].startswith("decode step") for c in report["validation"]["comparisons"])


@pytest.mark.parametrize("kv_cache, step", [
    ("appended", "GroupQueryAttention with past + padding bias"),
    ("shared", "GroupQueryAttention on a shared cache buffer (per-row lengths")])
def test_soft_capped_scores_with_a_cache(hf_folder, tmp_path, kv_cache, step):
    """Gemma 2 (issue 42): each layer steps on GQA with past and ``softcap``, its prompt on
    GQA; the runs GQA does not take (left-padded rows, a chunk after a past; with a shared
    buffer, a padded prompt past the window, where ORT's GQA departs on the padded queries)
    write the capped scores out. Verified on those runs by fuse, validated against PyTorch."""
    out = tmp_path / "gemma2.onnx"
    result = _export(hf_folder("gemma2"), out, "--kv-cache", kv_cache)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    layers = report["fused"].split("; ")
    assert len(layers) == 2 and all(step in form and "softcap 2" in form
                                    and "capped scores" in form for form in layers), layers
    from mha_onnx.graph.walk import all_nodes

    caps = {a.f for n in all_nodes(onnx.load(out).graph) if n.op_type == "GroupQueryAttention"
            for a in n.attribute if a.name == "softcap"}
    assert caps == {2.0}
    assert any(c["case"].startswith("decode step") for c in report["validation"]["comparisons"])


def test_a_changed_folder_is_said(hf_folder, tmp_path):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(hf_folder("bert"), folder)
    out = tmp_path / "bert.onnx"
    assert _export(folder, out).exit_code == 0
    config = json.loads((folder / "config.json").read_text())
    config["layer_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(config))
    report = validate_model(out, ValidateConfig())
    assert [c.passed for c in report.checks if c.name == "weights"] == [False]


@pytest.mark.parametrize("name, task, kernel", [
    ("bert", "feature-extraction", None), ("vit", "image-feature-extraction", "MultiHeadAttention"),
    ("siglip", "image-feature-extraction", "MultiHeadAttention"),
    ("wav2vec2", "feature-extraction", "MultiHeadAttention"),
    ("gemma3", "text-generation-with-past", "GroupQueryAttention")])
def test_encoders_vision_and_windowed_decoders(hf_folder, tmp_path, name, task, kernel):
    out = tmp_path / f"{name}.onnx"
    result = _export(hf_folder(name), out)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["task"] == task and "not fused" not in report["fused"]
    model = onnx.load(out)
    assert _ops(model) & {"MultiHeadAttention", "GroupQueryAttention", "If"}
    if kernel:
        assert kernel in _ops(model)
    if name == "wav2vec2":  # input_values over samples; verified at lengths it runs at
        assert [i.name for i in model.graph.input] == ["input_values", "attention_mask"]
        assert min(int(c["case"].split("sequence_length=")[1].rstrip(")")) for c in
                   report["validation"]["comparisons"] if "sequence_length=" in c["case"]) >= 20
    if name == "gemma3":  # sliding-window layers with a cache: GQA's local_window_size
        assert all("window 64" in form for form in report["fused"].split("; ")), report["fused"]


def test_float16_and_no_fuse(hf_folder, tmp_path):
    out = tmp_path / "llama16.onnx"
    result = _export(hf_folder("llama"), out, "--dtype", "float16", "--no-fuse")
    assert result.exit_code == 0, result.output
    model = onnx.load(out)
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert not _ops(model) & {"GroupQueryAttention", "MultiHeadAttention"}


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoders_export_an_encoder_and_a_decoder_with_a_cache(hf_folder, tmp_path,
                                                                        name):
    """An encoder-decoder: OUT.onnx is the decoder with its self-attention cache (cross K/V
    from encoder_hidden_states), OUT.encoder.onnx its encoder; both fused and validated
    against PyTorch (the decoder over a prompt and 16 steps), again without --reference
    (BART's position table bounds the lengths validate tries)."""
    out = tmp_path / "t5.onnx"
    result = _export(hf_folder(name), out)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["task"] == "text2text-generation-with-past"
    assert "not fused" not in report["fused"] and "encoder:" in report["fused"]
    decoder, encoder = onnx.load(out), onnx.load(tmp_path / "t5.encoder.onnx")
    assert [i.name for i in decoder.graph.input] == [
        "input_ids", "encoder_attention_mask", "encoder_hidden_states",
        "past_key_values.0.decoder.key", "past_key_values.0.decoder.value"]
    assert [o.name for o in decoder.graph.output] == [
        "logits", "present.0.decoder.key", "present.0.decoder.value"]
    assert [i.name for i in encoder.graph.input] == ["input_ids", "attention_mask"]
    assert "MultiHeadAttention" in _ops(decoder) and "MultiHeadAttention" in _ops(encoder)
    again = validate_model(out, ValidateConfig())
    assert again and any(c.case.startswith("decode step 16") for c in again.comparisons)
    assert validate_model(tmp_path / "t5.encoder.onnx", ValidateConfig())


def test_what_it_cannot_export_is_refused_with_the_reason(hf_folder, tmp_path):
    result = _export(hf_folder("llama"), tmp_path / "x.onnx", "--task",
                     "text2text-generation-with-past")
    assert result.exit_code == 2 and "does not fit" in result.output, result.output
    assert not (tmp_path / "x.onnx").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _export(empty, tmp_path / "x.onnx")
    assert result.exit_code == 2 and "config.json" in result.output
    clash = CliRunner().invoke(main, ["export", "--model", str(empty), "--preset", "base",
                                      "-o", str(tmp_path / "y.onnx")])
    assert clash.exit_code == 2 and "--model excludes --preset" in clash.output


@pytest.mark.parametrize(("fields", "routed"), [
    ({"num_local_experts": 4}, True), ({"n_routed_experts": 4}, True),
    ({"moe_num_experts": 4}, True),  # ERNIE 4.5 MoE: loaded with bmm experts since
    ({"num_experts": 0}, False), ({"num_experts_per_tok": 2}, False), ({}, False)])
def test_experts_are_found_by_any_count_of_them(tmp_path, fields, routed):
    """A mixture of experts loads with batched-matmul experts (torch.export cannot lower
    transformers' grouped_mm): found by any `*_experts` count in its config."""
    from mha_onnx.reference.hf import _has_experts

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", **fields}))
    assert _has_experts(tmp_path) is routed


def test_the_tolerance_reaches_fuses_verification_and_the_hint_names_exports_options(
        hf_folder, tmp_path):
    """--atol/--rtol set the verification's tolerance: at 1e-12 the float32 fusion (other
    kernels, other summation orders) is refused at exit 1 with the tolerance it would need,
    and the hint names export's --no-fuse, not fuse's --no-verify; nothing is written."""
    out = tmp_path / "llama.onnx"
    result = _export(hf_folder("llama"), out, "--atol", "1e-12", "--rtol", "0")
    assert result.exit_code == 1, result.output
    assert "fused graph differs from the original" in result.output
    assert "(atol 1e-12 + rtol 0" in result.output and "would need atol" in result.output
    assert "--no-fuse writes the export unfused" in result.output
    assert "--no-verify" not in result.output and not out.exists()
    reference = CliRunner().invoke(main, ["export", "-o", str(tmp_path / "r.onnx"), "--atol",
                                          "0.1"])
    assert reference.exit_code == 2 and "--atol/--rtol are for --model" in reference.output
