"""rewrite/shapes.py: dims read by Shape chains folded where they are static, left where
they are not (a symbolic dim never becomes a number)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from mha_onnx.rewrite.irutil import const_array
from mha_onnx.rewrite.shapes import fold_static_dims
from tests.irgraphs import F, model, node, tensor


def _fold(nodes):
    proto = model(nodes, [tensor("x", F, ["B", 4, "S", 16])], ["y"])
    graph = ir.from_proto(proto)
    folded = fold_static_dims(graph)
    (out,) = graph.graph.outputs
    return folded, out


@pytest.mark.parametrize(("picker", "want"), [
    ([node("Constant", [], "a", value_ints=[-1]), node("Constant", [], "b", value_ints=[2 ** 62]),
      node("Slice", ["s", "a", "b"], "p")], [16]),  # GPT-2's Shape(k)[-1:]
    ([node("Constant", [], "i", value_int=1), node("Gather", ["s", "i"], "p")], 4),
], ids=["slice-last", "gather-heads"])
def test_static_dims_read_by_shape_chains_fold(picker, want):
    nodes = [node("Shape", ["x"], "s"), *picker, node("Cast", ["p"], "y", to=1)]
    folded, out = _fold(nodes)
    assert folded == 1
    cast = out.producer()
    np.testing.assert_array_equal(const_array(cast.inputs[0]), np.array(want, np.int64))


@pytest.mark.parametrize("picker", [
    [node("Constant", [], "i", value_int=2), node("Gather", ["s", "i"], "p")],  # S
    [node("Constant", [], "a", value_ints=[0]), node("Constant", [], "b", value_ints=[2]),
     node("Slice", ["s", "a", "b"], "p")],  # [B, 4]: B is symbolic
], ids=["gather-symbolic", "slice-with-a-symbolic-dim"])
def test_symbolic_dims_are_left(picker):
    folded, out = _fold([node("Shape", ["x"], "s"), *picker, node("Cast", ["p"], "y", to=1)])
    assert folded == 0 and out.producer().inputs[0].producer().op_type in ("Gather", "Slice")
