"""Fusion: which op and form each attention block becomes (structure), that nothing unfused
is left, and that the fused graph computes what the original does (numbers, fully masked
rows included); plus the cases where a rule must not fire."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mha_onnx.config import MhaConfig, load_preset
from mha_onnx.errors import FusionError, ModelFileError
from mha_onnx.graph.inputs import ShapeCase, input_specs, make_inputs
from mha_onnx.rewrite import fuse_file, fuse_model
from mha_onnx.rewrite.check.verify import verify
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.runtime.ort import OrtRunner
from tests.fusing import fused_and_checked, ops

SMALL = MhaConfig(d_model=64, num_heads=4, name="small")


# -- this project's exports ---------------------------------------------------------------

EXPECTED_ORT = {
    ("self", "none"): "MultiHeadAttention",
    ("cross", "none"): "MultiHeadAttention",
    ("self", "causal"): "GroupQueryAttention",
    # top-left causal with S != T: GQA on the first S keys when S <= T, else the general form
    ("cross", "causal"): "If(S <= T): GroupQueryAttention (causal)",
    # right-padded self-attention: bidirectional GQA; otherwise by length (see FormPolicy)
    ("self", "key-padding"): "If(right padding, T <= 1024): GroupQueryAttention",
    ("cross", "key-padding"): "If(T < 128): MHA key_padding_mask | Loop(Compress keys)",
}


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("attention, mask", list(EXPECTED_ORT), ids=lambda x: str(x))
def test_own_exports_fuse_fully(export_cache, attention, mask, target):
    cfg = SMALL.replace(attention=attention, mask=mask)
    model = onnx.load(export_cache(cfg))
    fused, results = fused_and_checked(model, target)
    assert [r.status for r in results] == ["fused"]
    if target == "ort":
        assert results[0].form.startswith(EXPECTED_ORT[(attention, mask)])
        kernel = ("GroupQueryAttention" if mask == "causal"
                  or (attention, mask) == ("self", "key-padding") else "MultiHeadAttention")
        assert kernel in ops(fused)
        assert results[0].mask == {"none": "none", "causal": "causal", "key-padding": "key_padding"}[mask]
    else:
        assert "Attention" in ops(fused)
        assert {o.domain: o.version for o in fused.opset_import}[""] >= 23
    if mask == "key-padding" and target == "ort":
        assert "Loop" in ops(fused) and "Compress" in ops(fused)


def test_own_export_attributes(export_cache):
    """Scale and head count land on the kernel; K/V are the projections' 3-D outputs."""
    model = onnx.load(export_cache(SMALL.replace(d_k=24, d_v=8)))
    fused, _ = fused_and_checked(model)
    (mha,) = [n for n in fused.graph.node if n.op_type == "MultiHeadAttention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in mha.attribute}
    assert attrs["num_heads"] == 4
    assert math.isclose(attrs["scale"], 1 / math.sqrt(24), rel_tol=1e-6)
    producers = {o: n.op_type for n in fused.graph.node for o in n.output}
    assert [producers[i] for i in mha.input[:3]] == ["Add", "Add", "Add"]  # no transposes


@pytest.mark.parametrize("attention, mask", list(EXPECTED_ORT), ids=lambda x: str(x))
def test_no_layout_copy_runs_outside_the_kernels(export_cache, attention, mask):
    """Every form reads K/V from the projections' [B, T, H*D] outputs, and a length taken
    for an If is read from them too: no Reshape/Transpose of K or V stays in the main graph
    (a kept K transpose cost 5-10 % of a key-padding layer at batch 1, L = 16)."""
    model = onnx.load(export_cache(SMALL.replace(attention=attention, mask=mask)))
    fused, _ = fused_and_checked(model)
    assert "Transpose" not in [n.op_type for n in fused.graph.node]


def test_seq_dim_reads_the_length_before_the_layout_ops():
    import onnx_ir as ir

    from mha_onnx.rewrite.lower.common import TapeOps
    from mha_onnx.rewrite.sdpa import seq_dim

    x3 = ir.Value(name="x3", shape=ir.Shape(["B", "T", 32]), type=ir.TensorType(ir.DataType.FLOAT))
    ops = TapeOps()
    x4 = ops.Transpose(ops.Reshape(x3, ops.Constant(value=ir.tensor(np.array([0, 0, 4, 8], np.int64)))),
                       perm=[0, 2, 1, 3])
    x4.producer().inputs[0].shape = ir.Shape(["B", "T", 4, 8])
    x4.shape = ir.Shape(["B", 4, "T", 8])
    length = seq_dim(ops, x4, 2)
    assert length.producer().inputs[0] is x3
    assert length.producer().attributes["start"].as_int() == 1
    heads = seq_dim(ops, x4, 1)  # H is not a dim of x3: read from the reshaped tensor
    assert heads.producer().inputs[0].producer().op_type == "Reshape"
    assert heads.producer().attributes["start"].as_int() == 2


def test_causal_with_a_narrower_v_pads_it_for_gqa_and_a_wider_one_avoids_gqa(export_cache):
    """GQA takes one head size: a V narrower than K (DeepSeek's MLA) is padded with zeros to
    K's and the output cut back (verified over every branch); a wider V is not."""
    model = onnx.load(export_cache(SMALL.replace(mask="causal", d_k=16, d_v=8)))
    fused, results = fused_and_checked(model)
    assert results[0].form == "GroupQueryAttention (causal)"
    assert {"GroupQueryAttention", "Pad"} <= set(ops(fused))
    model = onnx.load(export_cache(SMALL.replace(mask="causal", d_k=8, d_v=16)))
    fused, results = fused_and_checked(model)
    assert results[0].form == "MultiHeadAttention + causal bias"
    assert "GroupQueryAttention" not in ops(fused)


@pytest.mark.parametrize("mask", ["none", "key-padding", "causal"])
def test_float16_exports(export_cache, mask):
    model = onnx.load(export_cache(SMALL.replace(dtype="float16", mask=mask)))
    fused, results = fused_and_checked(model)
    assert results[0].status == "fused"
    # half precision never takes GQA with seqlens_k on padded rows: ORT's CUDA GQA disagreed
    # there (docs/gpu/2026-11-30-h200.md, round 3), and a float16 model is a GPU model
    assert "right padding" not in results[0].form


@pytest.mark.parametrize("preset", ["base", "big"])
def test_presets(export_cache, preset):
    model = onnx.load(export_cache(load_preset(preset).replace(mask="key-padding")))
    _, results = fused_and_checked(model)
    assert results[0].form.startswith("If(right padding, T <= 1024)")


# -- fully masked rows: each form reproduces the original exactly -------------------------

def _all_padded_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    specs = input_specs(model)
    feeds = make_inputs(specs, ShapeCase("x", {n: v for n, v in zip(
        [d for s in specs for d in s.dims if isinstance(d, str)], [2, 6, 6, 6], strict=False)}))
    for spec in specs:
        if spec.dtype == np.bool_:
            feeds[spec.name][:] = False
            feeds[spec.name][1, :] = True  # batch entry 1: every key padded
    return feeds


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_fully_padded_rows_stay_nan(export_cache, target):
    model = onnx.load(export_cache(SMALL.replace(mask="key-padding")))
    fused, _, _ = fuse_model(model, FormPolicy(target=target))
    feeds = _all_padded_feeds(model)
    want = OrtRunner(model.SerializeToString()).infer(feeds)["output"]
    got = OrtRunner(fused.SerializeToString()).infer(feeds)["output"]
    assert np.isnan(want[1]).all() and np.isfinite(want[0]).all()
    assert np.isnan(got[1]).all()
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)


# -- graphs exported elsewhere --------------------------------------------------------------

SELF_PADDED = "If(right padding, T <= 1024): GroupQueryAttention (bidirectional)"
CROSS_PADDED = "If(T < 128): MHA key_padding_mask | Loop(Compress keys)"
ZOO_FORMS = {
    "torch_mha_self_bf": "MultiHeadAttention",
    "torch_mha_self_sf": "MultiHeadAttention",
    "torch_mha_cross_bf": "MultiHeadAttention",
    "torch_mha_cross_sf": "MultiHeadAttention",
    "torch_mha_key_padding": SELF_PADDED,
    "torch_mha_causal": "GroupQueryAttention",
    "sdpa18_none": "MultiHeadAttention",
    "sdpa18_bool": "MultiHeadAttention + attention_bias",
    "sdpa18_float": "MultiHeadAttention + attention_bias",
    "sdpa18_causal": "GroupQueryAttention",
    "sdpa18_key_padding": CROSS_PADDED,
    "sdpa23_none": "MultiHeadAttention",
    "sdpa23_bool": "MultiHeadAttention + attention_bias",
    "sdpa23_float": "MultiHeadAttention + attention_bias",
    "sdpa23_causal": "GroupQueryAttention",
    "sdpa23_key_padding": CROSS_PADDED,
    "scale_div": "MultiHeadAttention",
    "scale_mul": "MultiHeadAttention",
    "scale_split": "MultiHeadAttention",
    "scale_none": "MultiHeadAttention",
    "bmm_rank3": "MultiHeadAttention",
    "encoder_post_norm": SELF_PADDED,
    "encoder_pre_norm": SELF_PADDED,
    # per block: causal self-attention, padded cross-attention (two layers)
    "decoder_post_norm": ("GroupQueryAttention", CROSS_PADDED) * 2,
    "decoder_pre_norm": ("GroupQueryAttention", CROSS_PADDED) * 2,
    # Hugging Face builds padding masks with GatherND over aranges: recognised as key padding
    "hf_bert": SELF_PADDED,
    "hf_bert_eager": SELF_PADDED,
    # causal + padding: GQA with seqlens_k when right-padded (checked at run time)
    "hf_gpt2": "If(right padding): GroupQueryAttention (causal)",
    "hf_gpt2_eager": "If(right padding): GroupQueryAttention (causal)",
    # encoder (padding), decoder self (causal, no decoder mask given), cross (padding)
    "hf_bart": (SELF_PADDED, "GroupQueryAttention (causal)", CROSS_PADDED),
    # encoder: relative position bias + padding (dense); decoder: causal + position bias;
    # cross-attention: padding only
    "hf_t5": ("MultiHeadAttention + attention_bias", "GroupQueryAttention (causal, bias)",
              CROSS_PADDED),
    "hf_vit": "MultiHeadAttention",
}


@pytest.mark.parametrize("name", list(ZOO_FORMS))
def test_foreign_graphs_fuse_for_ort(zoo, name):
    model = zoo(name)
    fused, results = fused_and_checked(model)
    assert results and all(r.status == "fused" for r in results)
    expected = ZOO_FORMS[name]
    if isinstance(expected, tuple):
        assert len(results) == len(expected)
        assert all(r.form.startswith(e) for r, e in zip(results, expected, strict=True)), [
            r.form for r in results]
    else:
        assert all(r.form.startswith(expected) for r in results), [r.form for r in results]


@pytest.mark.parametrize("name", [
    "torch_mha_key_padding", "torch_mha_causal", "sdpa18_bool", "sdpa18_key_padding",
    "sdpa23_key_padding", "decoder_pre_norm", "hf_bert", "hf_gpt2", "hf_t5",
])
def test_foreign_graphs_fuse_for_onnx_attention(zoo, name):
    fused, results = fused_and_checked(zoo(name), target="onnx")
    assert all(r.status == "fused" for r in results)
    assert "Attention" in ops(fused) and "MultiHeadAttention" not in ops(fused)


def test_torch_opset23_attention_that_ort_refuses_is_repaired(zoo):
    model = zoo("sdpa23_key_padding")
    feeds = make_inputs(input_specs(model), ShapeCase("x", {"batch": 2, "seq": 3, "seq_kv": 5}))
    with pytest.raises(ModelFileError, match="q_sequence_length"):
        OrtRunner(model.SerializeToString()).infer(feeds)
    fused, _, _ = fuse_model(model)
    assert OrtRunner(fused.SerializeToString()).infer(feeds)
    assert "reference evaluator" in verify(model, fused).reference


# -- where a rule must not fire --------------------------------------------------------------

def _graph(nodes, inputs, outputs, inits=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _qkv(b="B", h=2, s="S", t="T", d=8, kh=None, vh=None):
    f = TensorProto.FLOAT
    return [helper.make_tensor_value_info("q", f, [b, h, s, d]),
            helper.make_tensor_value_info("k", f, [b, kh or h, t, d]),
            helper.make_tensor_value_info("v", f, [b, vh or kh or h, t, d])]


def _attention(axis=-1, scale_input=None, extra_output=False, kh=None, vh=None,
               between="Identity"):
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"])]
    inputs = _qkv(kh=kh, vh=vh)
    if scale_input:
        inputs.append(helper.make_tensor_value_info("scale", f, []))
        nodes.append(helper.make_node("Mul", ["qk", "scale"], ["scores"]))
    else:
        nodes.append(helper.make_node(between, ["qk"], ["scores"]))
    nodes += [helper.make_node("Softmax", ["scores"], ["p"], axis=axis),
              helper.make_node("MatMul", ["p", "v"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", f, None)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info("p", f, None))
    return _graph(nodes, inputs, outputs)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"axis": 2}, "not over the keys"),
        ({"scale_input": True}, "non-constant"),
        ({"extra_output": True}, "also used elsewhere"),
        ({"kh": 1, "vh": 2}, "not grouped"),  # K broadcast over heads, V not: no kernel
    ],
    ids=["softmax-axis", "dynamic-scale", "weights-returned", "heads-mismatch"],
)
def test_rules_do_not_fire_and_say_why(kwargs, reason):
    model = _attention(**kwargs)
    fused, results, _ = fuse_model(model)
    assert [r.status for r in results] == ["left"]
    assert reason in results[0].reason
    assert "Softmax" in ops(fused)
    # export --model's "fused:" line names the block left and why (it printed nothing here)
    said = results[0].said()
    assert said.startswith(f"{results[0].block} left (") and reason in said


def test_unknown_op_between_qk_and_softmax_is_reported():
    fused, results, _ = fuse_model(_attention(between="Relu"))
    assert results[0].status == "left" and "Relu between" in results[0].reason
    _, results, _ = fuse_model(_attention(between="Identity"))  # optimised away: fine
    assert results[0].status == "fused" and results[0].said() == results[0].form != ""


def test_no_attention_model_is_copied_with_a_note(tmp_path):
    f = TensorProto.FLOAT
    model = _graph([helper.make_node("Relu", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", f, ["N"])],
                   [helper.make_tensor_value_info("y", f, ["N"])])
    onnx.save(model, tmp_path / "relu.onnx")
    report = fuse_file(tmp_path / "relu.onnx", tmp_path / "out.onnx")
    assert report.blocks == () and report.written
    assert any("no attention block" in note for note in report.notes)


def test_mismatch_refuses_to_write(export_cache, tmp_path, monkeypatch):
    """If a lowering computed something else, fuse must fail and write nothing."""
    import mha_onnx.rewrite.lower.ort as lower

    real = lower._mha

    def wrong_scale(op, q3, k, v, info, bias=None):
        return real(op, q3, k, v, type(info)(**{**info.__dict__, "scale": info.scale * 1.5}), bias)

    monkeypatch.setattr(lower, "_mha", wrong_scale)
    path = export_cache(SMALL)
    out = tmp_path / "fused.onnx"
    with pytest.raises(FusionError, match="output 'output'"):
        fuse_file(path, out)
    assert not out.exists()
    assert fuse_file(path, out, verify_result=False).verification is None


def test_form_override_from_the_cli(export_cache, tmp_path):
    from click.testing import CliRunner

    from mha_onnx.cli import main

    src = export_cache(SMALL.replace(mask="key-padding"))
    out = tmp_path / "f.onnx"
    result = CliRunner().invoke(main, ["fuse", str(src), "-o", str(out), "--form", "key_padding=mask",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert "key_padding_mask" in result.output and "Loop" not in ops(onnx.load(out))
    bad = CliRunner().invoke(main, ["fuse", str(src), "-o", str(out), "--form", "causal=fast"])
    assert bad.exit_code == 2 and "unknown causal form 'fast'" in bad.output
