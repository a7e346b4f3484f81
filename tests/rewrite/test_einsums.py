"""blocked_einsums: attention over blocks written as 5-D Einsums (LongT5's local attention)
rewritten as 4-D MatMuls over the blocks stacked on the batch; the same values, and blocks
spelt otherwise left as they are."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper
from onnxscript.optimizer import remove_unused_nodes

from mha_onnx.rewrite.prepare.einsums import blocked_einsums

B, NB, BL, KL, H, D = 2, 3, 4, 12, 2, 8


def _model(qk: str = "...qhd,...khd->...hqk", pv: str = "...hqk,...khd->...qhd",
           axis: int = -1) -> onnx.ModelProto:
    nodes = [helper.make_node("Einsum", ["q", "k"], ["s"], equation=qk),
             helper.make_node("Add", ["s", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["p"], axis=axis),
             helper.make_node("Einsum", ["p", "v"], ["out"], equation=pv)]
    inputs = [helper.make_tensor_value_info("q", TP.FLOAT, [B, NB, BL, H, D]),
              helper.make_tensor_value_info("k", TP.FLOAT, [B, NB, KL, H, D]),
              helper.make_tensor_value_info("v", TP.FLOAT, [B, NB, KL, H, D]),
              helper.make_tensor_value_info("mask", TP.FLOAT, [B, NB, 1, BL, KL])]
    out = helper.make_tensor_value_info("out", TP.FLOAT, None)
    graph = helper.make_graph(nodes, "blocks", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model: onnx.ModelProto, feeds) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _feeds():
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((B, NB, L, H, D)).astype(np.float32)
             for n, L in (("q", BL), ("k", KL), ("v", KL))}
    keep = rng.random((B, NB, 1, BL, KL)) > 0.3
    feeds["mask"] = np.where(keep, 0.0, -1e10).astype(np.float32)
    return feeds


def test_blocks_become_4d_matmuls_with_the_same_values():
    original = _model()
    model = ir.from_proto(original)
    assert blocked_einsums(model) == 1
    rewritten = ir.to_proto(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("MatMul") == 2 and "Softmax" in ops
    feeds = _feeds()
    np.testing.assert_allclose(_run(rewritten, feeds), _run(original, feeds), atol=1e-5)


@pytest.mark.parametrize("change", [
    {"qk": "...qhd,...khd->...hkq"},  # scores as [.., h, k, q]: the Softmax is not over keys
    {"axis": 2},  # a Softmax over another axis
    {"pv": "...hqk,...qhd->...khd"},  # the weights contracted over the queries
])
def test_other_spellings_are_left(change):
    model = ir.from_proto(_model(**change))
    assert blocked_einsums(model) == 0


def _joined_model() -> onnx.ModelProto:
    """Pegasus-X's local attention: each block's queries against the global keys (one
    Einsum, broadcast over the blocks) and the block's keys (another), concatenated before
    the Softmax, the weights sliced apart for their two values, the products added."""
    g, x = 2, 6
    const = [helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, TP.INT64, [1], [v])) for name, v in (("zero", 0), ("cut", g), ("end", 1 << 40),
                                                     ("last", -1))]
    nodes = [*const,
             helper.make_node("Einsum", ["q", "kg"], ["sg"], equation="BHNKF,BHGF->BHNKG"),
             helper.make_node("Einsum", ["q", "kl"], ["sl"], equation="BHNKF,BHNXF->BHNKX"),
             helper.make_node("Concat", ["sg", "sl"], ["s"], axis=-1),
             helper.make_node("Add", ["s", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
             helper.make_node("Slice", ["p", "zero", "cut", "last"], ["pg"]),
             helper.make_node("Slice", ["p", "cut", "end", "last"], ["pl"]),
             helper.make_node("Einsum", ["pg", "vg"], ["og"], equation="BHNKG,BHGF->BHNKF"),
             helper.make_node("Einsum", ["pl", "vl"], ["ol"], equation="BHNKX,BHNXF->BHNKF"),
             helper.make_node("Add", ["og", "ol"], ["out"])]
    shapes = {"q": [B, H, NB, BL, D], "kg": [B, H, g, D], "vg": [B, H, g, D],
              "kl": [B, H, NB, x, D], "vl": [B, H, NB, x, D], "mask": [B, 1, NB, BL, g + x]}
    inputs = [helper.make_tensor_value_info(n, TP.FLOAT, s) for n, s in shapes.items()]
    graph = helper.make_graph(nodes, "joined", inputs,
                              [helper.make_tensor_value_info("out", TP.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_global_keys_beside_each_block_become_one_attention():
    original = _joined_model()
    model = ir.from_proto(original)
    assert blocked_einsums(model) == 1
    remove_unused_nodes(model)  # (as the Normalise pass does)
    rewritten = ir.to_proto(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Slice" not in ops and ops.count("MatMul") == 2 and ops.count("Softmax") == 1
    rng = np.random.default_rng(1)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]
                                         ).astype(np.float32) for i in original.graph.input}
    feeds["mask"] = np.where(feeds["mask"] > -0.5, 0.0, -1e9).astype(np.float32)
    np.testing.assert_allclose(_run(rewritten, feeds), _run(original, feeds), atol=1e-5)
