"""Masks computed from one [B, T] input's values (TorchScript's advanced indexing spelling),
judged by evaluation: causal + key padding accepted, near misses refused. Graphs built with
onnx.helper, without value_info (as TorchScript writes them)."""

from __future__ import annotations

import pytest
from onnx import TensorProto

from mha_onnx.rewrite import fuse_model
from tests.irgraphs import B64, F, const, model, node, tensor

H, D = 2, 8


def _attention(keep_index: str = "b*T+t", causal: bool = True) -> list:
    """Q·K^T/sqrt(D) + Where(keep, 0, min) -> Softmax -> ·V, where ``keep`` is
    ``flatten(attention_mask)[index]`` (And the causal triangle)."""
    nodes = [
        node("Shape", ["attention_mask"], "mshape"),
        const("i0", 0), const("i1", 1), const("one", 1), const("zero", 0),
        node("Gather", ["mshape", "i0"], "nb", axis=0),
        node("Gather", ["mshape", "i1"], "nt", axis=0),
        node("Range", ["zero", "nb", "one"], "rb"),
        node("Range", ["zero", "nt", "one"], "rt"),
        const("ax_b", [1, 2, 3]), node("Unsqueeze", ["rb", "ax_b"], "b4"),  # [B,1,1,1]
        const("ax_t", [0, 1, 2]), node("Unsqueeze", ["rt", "ax_t"], "t4"),  # [1,1,1,T]
        node("Mul", ["b4", "nt"], "bT"),
    ]
    if keep_index == "b*T+t":
        nodes.append(node("Add", ["bT", "t4"], "idx"))
    elif keep_index == "b*T":  # every key of a row reads the row's first flag: a near miss
        nodes.append(node("Add", ["bT", "zero"], "idx0"))
        nodes.append(node("Add", ["idx0", "t4"], "idx_wrong"))
        nodes.append(node("Sub", ["idx_wrong", "t4"], "idx"))
    nodes += [
        node("Cast", ["attention_mask"], "mbool", to=TensorProto.BOOL),
        const("flat_shape", [-1]), node("Reshape", ["mbool", "flat_shape"], "flat"),
        node("Gather", ["flat", "idx"], "pad_keep", axis=0),  # [B,1,1,T]
        node("Shape", ["q"], "qshape"), const("i2", 2),
        node("Gather", ["qshape", "i2"], "ns", axis=0),
        node("Range", ["zero", "ns", "one"], "rs"),
        const("ax_s", [0, 1, 3]), node("Unsqueeze", ["rs", "ax_s"], "s4"),  # [1,1,S,1]
        node("LessOrEqual", ["t4", "s4"], "causal_keep"),
    ]
    keep = "pad_keep"
    if causal:
        nodes.append(node("And", ["causal_keep", "pad_keep"], "keep"))
        keep = "keep"
    nodes += [
        node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]),
        node("MatMul", ["q", "kt"], "qk"),
        const("scale", 1.0 / D ** 0.5), node("Mul", ["qk", "scale"], "scaled"),
        const("fzero", 0.0), const("fmin", (-3.4028234663852886e38)),
        node("Where", [keep, "fzero", "fmin"], "bias"),
        node("Add", ["scaled", "bias"], "scores"),
        node("Softmax", ["scores"], "probs", axis=-1),
        node("MatMul", ["probs", "v"], "out"),
    ]
    return nodes


def _model(nodes):
    inputs = [tensor("q", F, ["B", H, "S", D]), tensor("k", F, ["B", H, "S", D]),
              tensor("v", F, ["B", H, "S", D]), tensor("attention_mask", B64, ["B", "S"])]
    return model(nodes, inputs, ["out"], out_types={"out": (F, ["B", H, "S", D])})


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "padding only"])
def test_gathered_padding_is_proven_by_evaluation(causal):
    _, results, _ = fuse_model(_model(_attention(causal=causal)))
    (result,) = results
    assert result.status == "fused"
    assert result.meaning == ("causal + key padding" if causal else "key padding")


def test_a_mask_that_only_looks_like_padding_is_refused():
    """Every key of a row masked by the row's first flag: value-dependent, [B, 1, 1, T],
    the same structure, but not the padding of each key: only the dense form is exact."""
    _, results, _ = fuse_model(_model(_attention(keep_index="b*T")))
    (result,) = results
    assert result.meaning.startswith("dense bias"), result.meaning
    assert result.form == "MultiHeadAttention + attention_bias"


def _alibi_padding_model(table: int, bias_from_input: bool = False):
    """Scores + a per-head table [H, 1, table] sliced to the last T keys (MPT's ALiBi, added
    before the mask), then TorchScript's gathered padding of keys T = P + S (a past and new
    keys): the table is a position bias (sizes only), the padding a value mask judged as a
    whole."""
    import numpy as np

    slopes = np.arange(1, H + 1, dtype=np.float32)[:, None, None]
    alibi = (slopes * np.arange(-table + 1, 1, dtype=np.float32)[None, None, :]) / 8
    nodes = [
        node("Concat", ["past_k", "new_k"], "k", axis=2),
        node("Concat", ["past_v", "new_v"], "v", axis=2),
        const("table", alibi), const("table_len", [table]), const("axis2", [2]),
        node("Shape", ["k"], "t_1d", start=2, end=3),
        node("Sub", ["table_len", "t_1d"], "start"),
        node("Slice", ["table", "start", "table_len", "axis2"], "position_bias"),
    ]
    if bias_from_input:  # a near miss: the "bias" reads the keys' values
        nodes += [const("r_axes", [0, 3]), node("ReduceMean", ["k", "r_axes"], "k_mean"),
                  node("Mul", ["position_bias", "k_mean"], "bias_term")]
    else:
        nodes.append(node("Identity", ["position_bias"], "bias_term"))
    nodes += [
        node("Shape", ["attention_mask"], "mshape"), const("i0", 0), const("i1", 1),
        const("one", 1), const("zero", 0),
        node("Gather", ["mshape", "i0"], "nb", axis=0),
        node("Gather", ["mshape", "i1"], "nt", axis=0),
        node("Range", ["zero", "nb", "one"], "rb"), node("Range", ["zero", "nt", "one"], "rt"),
        const("ax_b", [1, 2, 3]), node("Unsqueeze", ["rb", "ax_b"], "b4"),
        const("ax_t", [0, 1, 2]), node("Unsqueeze", ["rt", "ax_t"], "t4"),
        node("Mul", ["b4", "nt"], "bT"), node("Add", ["bT", "t4"], "idx"),
        node("Cast", ["attention_mask"], "mbool", to=TensorProto.BOOL),
        const("flat_shape", [-1]), node("Reshape", ["mbool", "flat_shape"], "flat"),
        node("Gather", ["flat", "idx"], "keep", axis=0),  # [B,1,1,T]
        node("Not", ["keep"], "masked"),
        node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]),
        node("MatMul", ["q", "kt"], "qk"),
        const("scale", 1.0 / D ** 0.5), node("Mul", ["qk", "scale"], "scaled"),
        node("Add", ["scaled", "bias_term"], "biased"),
        const("fmin", (-3.4028234663852886e38)),
        node("Where", ["masked", "fmin", "biased"], "scores"),
        node("Softmax", ["scores"], "probs", axis=-1),
        node("MatMul", ["probs", "v"], "out"),
    ]
    inputs = [tensor("q", F, ["B", H, "S", D]), tensor("new_k", F, ["B", H, "S", D]),
              tensor("new_v", F, ["B", H, "S", D]), tensor("past_k", F, ["B", H, "P", D]),
              tensor("past_v", F, ["B", H, "P", D]),
              tensor("attention_mask", B64, ["B", "P + S"])]
    return model(nodes, inputs, ["out"], out_types={"out": (F, ["B", H, "S", D])})


def test_a_position_bias_added_before_a_torchscript_mask_is_a_bias(tmp_path):
    """Evaluated apart from the value mask (which it would otherwise vary per head), and
    within its table: keys P + S past 128 do not fit it, so the model runs no longer either;
    the longest lengths that fit (half the base: a sum of two dims) are tried instead."""
    import onnx

    from mha_onnx.rewrite import fuse_file

    onnx.save(_alibi_padding_model(table=128), tmp_path / "alibi.onnx")
    report = fuse_file(tmp_path / "alibi.onnx", tmp_path / "fused.onnx")
    (result,) = report.blocks
    assert result.status == "fused"
    assert result.meaning == "key padding + position bias", result.meaning
    assert report.verification is not None and report.verification.passed


def test_a_bias_that_reads_values_before_a_torchscript_mask_stays_dense():
    _, results, _ = fuse_model(_alibi_padding_model(table=128, bias_from_input=True))
    (result,) = results
    assert result.meaning.startswith("dense bias"), result.meaning
