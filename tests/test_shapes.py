"""rewrite/shapes.py: dims read by Shape chains folded where they are static, left where
they are not (a symbolic dim never becomes a number)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from mha_onnx.rewrite.irutil import const_array
from mha_onnx.rewrite.shapes import fold_static_dims, with_symbolic_shapes
from tests.irgraphs import F, const, model, node, tensor


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


def _repeat_interleave() -> list:
    """y = x.repeat_interleave(2, dim=-1) for x [B, S, 8], as the TorchScript exporter
    writes it (Cohere's, GLM's and Helium's interleaved rotary): the repeat count is the max
    of a ConstantOfShape over the repeated dim."""
    return [
        node("Shape", ["x"], "dims", start=0, end=3), node("Shape", ["x"], "last", start=2,
                                                          end=3),
        node("ConstantOfShape", ["last"], "twos",
             value=helper.make_tensor("v", TensorProto.INT64, [1], [2])),
        node("ReduceMax", ["twos"], "count", keepdims=0),
        const("ax0", [0]), node("Unsqueeze", ["count", "ax0"], "count_1d"),
        node("Concat", ["dims", "count_1d"], "target", axis=0),
        const("ax_last", [-1]), node("Unsqueeze", ["x", "ax_last"], "x_1"),
        node("Expand", ["x_1", "target"], "repeated"),
        node("Shape", ["x"], "lead", start=0, end=2), const("minus_one", [-1]),
        node("Concat", ["lead", "minus_one"], "flat", axis=0),
        node("Reshape", ["repeated", "flat"], "y"),
    ]


def test_a_repeat_count_taken_by_reducemax_is_read():
    proto = model(_repeat_interleave(), [tensor("x", F, ["B", "S", 8])], ["y"])
    inferred = {v.name: v for v in with_symbolic_shapes(proto).graph.value_info}
    dims = [d.dim_param or d.dim_value for d in inferred["y"].type.tensor_type.shape.dim]
    assert dims == ["B", "S", 16]


def test_incomplete_inference_writes_nothing_where_it_runs(tmp_path, monkeypatch):
    """ORT's own infer_shapes saves sym_shape_infer_temp.onnx into the working folder when it
    cannot finish; fuse's driver keeps what it found and writes nothing."""
    monkeypatch.chdir(tmp_path)
    proto = model([node("Shape", ["x"], "s"), node("Foo", ["x"], "y", domain="custom.ops")],
                  [tensor("x", F, ["B", 8])], ["y", "s"])
    proto.opset_import.append(helper.make_opsetid("custom.ops", 1))
    inferred = with_symbolic_shapes(proto)
    assert not list(tmp_path.iterdir())
    assert inferred is proto or any(v.name == "s" for v in inferred.graph.value_info)
