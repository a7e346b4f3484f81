"""`export --model --dtype float16`: an activation past float16's range is refused with the
module it came from, and `--keep-float32 MODULE` keeps that module in float32 (its weights
and what it computes), the rest in float16.

The model: a small Llama whose first MLP's product (gate x up) passes 65504 while what the
MLP gives back fits float16 (its norm's gain scaled up, its down projection down). ORT's CPU
provider computes that product in float32 and hides it: the outputs are finite here, inf
where float16 kernels run."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main

MLP = "model.layers.0.mlp"
pytestmark = pytest.mark.transformers  # (exports through torch.export: not the fast suite)


@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=99, max_position_embeddings=128, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_key_value_heads=2))
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight *= 1500
        model.model.layers[0].mlp.down_proj.weight *= 1e-2
    folder = tmp_path_factory.mktemp("loud")
    model.save_pretrained(folder)
    return folder


def _export(folder, out, *extra):
    return CliRunner().invoke(main, ["export", "--model", str(folder), "-o", str(out),
                                     "--dtype", "float16", *extra])


def test_an_overflow_hidden_by_the_cpu_is_refused_with_the_module_to_keep(loud, tmp_path):
    out = tmp_path / "plain.onnx"
    result = _export(loud, out, "--no-fuse")
    assert result.exit_code == 1, result.output
    assert "outputs finite on ORT's CPU provider" in result.output
    assert f"[{MLP}] (Mul) makes inf/NaN" in result.output
    assert f"--keep-float32 {MLP} keeps that module in float32" in result.output
    assert not out.exists()


def test_the_kept_module_computes_in_float32_and_passes(loud, tmp_path):
    from mha_onnx.graph import metadata
    from mha_onnx.parity import ValidateConfig, validate_model

    out = tmp_path / "kept.onnx"
    result = _export(loud, out, "--keep-float32", MLP, "--kv-cache", "shared", "--json")
    assert result.exit_code == 0, result.output
    assert "GroupQueryAttention" in json.loads(result.output[result.output.index("{"):])["fused"]
    model = onnx.load(out)
    assert metadata.decoded(model)["hf_model"]["float32_modules"] == [MLP]
    matrices = [t.data_type for t in model.graph.initializer if len(t.dims) == 2]
    # the kept MLP's gate, up and down; every other weight matrix in float16
    assert matrices.count(onnx.TensorProto.FLOAT) == 3
    assert matrices.count(onnx.TensorProto.FLOAT16) >= 8
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [
        onnx.TensorProto.FLOAT16] * len(model.graph.output)
    report = validate_model(out, ValidateConfig(ranges=True))
    assert report.exit_code == 0 and report.ranges.overflow is None
    assert report.ranges.half and not report.ranges.near  # (the kept product is float32)
    assert max(p.peak for p in report.ranges.peaks if p.bits == 32) > 65504
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[5, 6, 7, 8], [9, 10]]")
    generated = CliRunner().invoke(main, ["generate", str(out), "--prompts", str(prompts),
                                          "--max-new-tokens", "8", "--json"])
    assert generated.exit_code == 0, generated.output
    assert json.loads(generated.output)["sequences"] == _greedy(loud, [[5, 6, 7, 8], [9, 10]])


def _greedy(folder, prompts, new=8):
    """transformers' greedy tokens of the folder's model in float32, each prompt alone."""
    import torch

    from mha_onnx.reference.hf import load_module

    model = load_module(folder, "text-generation-with-past", "float32")
    return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                           min_new_tokens=new)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize(("extra", "said"), [
    (("--keep-float32", "model.layer.0.mlp"), "names no module of the model"),
    (("--keep-float32", "model.layers.0.self_attn"), "holds LlamaAttention"),
    (("--keep-float32", "model.layers.0"), "the cache would be float32"),
    (("--keep-float32", MLP, "--dtype", "float32"), "keeps modules of a float16 export"),
])
def test_what_cannot_be_kept_is_refused_before_the_export(loud, tmp_path, extra, said):
    result = _export(loud, tmp_path / "x.onnx", *extra)
    assert result.exit_code == 2 and said in result.output, result.output
    assert "torch.export" not in result.output and not (tmp_path / "x.onnx").exists()


def test_a_module_whose_weights_another_shares_is_refused(tmp_path):
    """A tied LM head kept in float32 would turn the embedding float32 with it."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=99, max_position_embeddings=64, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, tie_word_embeddings=True)
    ).save_pretrained(tmp_path / "tied")
    result = _export(tmp_path / "tied", tmp_path / "x.onnx", "--keep-float32", "lm_head")
    assert result.exit_code == 2, result.output
    assert "lm_head: its weights are model.embed_tokens's too (tied)" in result.output
    assert "torch.export" not in result.output


def test_the_casts_keep_pytorchs_values(loud):
    """The kept module's hooks: float16 in, float32 inside, float16 out; the model's logits
    finite where the all-float16 model's are not, and near float32's."""
    import torch

    from mha_onnx.export.islands import keep_float32
    from mha_onnx.reference.hf import load_module

    ids = torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    task = "text-generation-with-past"
    wide = load_module(loud, task, "float32")(ids).logits.detach().numpy()
    half = load_module(loud, task, "float16")
    assert not torch.isfinite(half(ids).logits).all()
    assert keep_float32(half, ["model.layers.*.mlp", MLP + ".*"]) == [
        MLP, "model.layers.1.mlp"]  # (the outermost of what the patterns name)
    got = half(ids).logits
    assert got.dtype == torch.float16
    np.testing.assert_allclose(got.float().detach().numpy(), wide, atol=0.05)


@pytest.mark.parametrize(("name", "module", "holds"), [
    ("t5", "decoder.block.0.layer.1.EncDecAttention", "T5Attention"),  # (cross-attention)
    ("bart", "model.decoder.layers.0", "BartAttention")])
def test_an_encoder_decoders_cache_writers_are_refused_before_the_export(
        hf_folder, tmp_path, name, module, holds):
    """An encoder-decoder's decoder attention (self- or cross-: both cache) kept in float32
    is refused before torch.export, as a decoder's is; its encoder's attention is not."""
    result = _export(hf_folder(name), tmp_path / "x.onnx", "--keep-float32", module)
    assert result.exit_code == 2, result.output
    assert f"holds {holds}" in result.output and "the cache would be float32" in result.output
    assert "torch.export" not in result.output and not (tmp_path / "x.onnx").exists()


def test_an_encoder_decoders_encoder_attention_may_be_kept(hf_folder):
    import torch

    from mha_onnx.export.islands import keep_float32
    from mha_onnx.reference.hf import load_module

    model = load_module(hf_folder("t5"), "text2text-generation-with-past", "float16")
    kept = keep_float32(model, ["encoder.block.*.layer.0.SelfAttention"],
                        cache_writer=model.get_decoder())
    assert kept == ["encoder.block.0.layer.0.SelfAttention"]
    assert model.get_submodule(kept[0]).q.weight.dtype == torch.float32
    assert model.get_submodule("decoder.block.0.layer.0.SelfAttention").q.weight.dtype \
        == torch.float16


def test_an_encoders_overflow_names_the_module_as_keep_float32_takes_it(tmp_path):
    """T5 in float16: the log of 0 its relative position buckets take on purpose (a Where
    drops it) is no overflow; what passes 65504 in its encoder's gated MLP is, named by the
    module's name in the whole model (the encoder part's recorded names start below
    ``encoder``), and keeping the MLP exports."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        feed_forward_proj="gated-gelu"))
    with torch.no_grad():
        model.encoder.block[0].layer[1].layer_norm.weight *= 1500
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight *= 1e-3
    model.save_pretrained(tmp_path / "loud_t5")
    mlp = "encoder.block.0.layer.1.DenseReluDense"
    refused = _export(tmp_path / "loud_t5", tmp_path / "x.onnx")
    assert refused.exit_code != 0, refused.output  # (its tanh GELU's cube, first)
    assert f"--keep-float32 {mlp}.act keeps" in refused.output, refused.output
    kept = _export(tmp_path / "loud_t5", tmp_path / "kept.onnx", "--keep-float32", mlp)
    assert kept.exit_code == 0, kept.output
