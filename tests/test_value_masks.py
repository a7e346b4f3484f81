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
