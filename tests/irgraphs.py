"""Small graphs built with ``onnx.helper`` for the recogniser unit tests, and a way to look
up their values by name in onnx-ir (after shape inference, as ``fuse`` sees them)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnx import TensorProto, helper, numpy_helper

F, B64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def tensor(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def const(name: str, value) -> onnx.NodeProto:
    """A Constant: Python floats become float32, ints int64."""
    array = np.array(value)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array))


def node(op: str, inputs: list[str], output: str, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], **attrs)


def model(nodes: list, inputs: list, outputs: list[str], opset: int = 18,
          out_types: dict[str, tuple[int, list]] | None = None) -> onnx.ModelProto:
    """A model of ``nodes``; outputs untyped (types come from inference) unless given in
    ``out_types`` (which a file on disk needs to pass onnx.checker)."""
    out_types = out_types or {}
    outs = [helper.make_tensor_value_info(o, *out_types[o]) if o in out_types
            else onnx.ValueInfoProto(name=o) for o in outputs]
    graph = helper.make_graph(nodes, "g", inputs, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


class Graph:
    """An onnx-ir view of ``proto`` with shapes inferred; ``graph["name"]`` is a value."""

    def __init__(self, proto: onnx.ModelProto) -> None:
        self.model = ir.from_proto(proto)
        common_passes.ShapeInferencePass()(self.model)
        self.values = {v.name: v for v in self.model.graph.inputs}
        for n in self.model.graph:
            for out in n.outputs:
                self.values[out.name] = out

    def __getitem__(self, name: str) -> ir.Value:
        return self.values[name]

    def node(self, output: str) -> ir.Node:
        producer = self.values[output].producer()
        assert producer is not None
        return producer


def shape_of(source: str, axis: int, out: str) -> list[onnx.NodeProto]:
    """``out`` = Shape(source)[axis] as a 1-element int64 tensor."""
    return [node("Shape", [source], out, start=axis, end=axis + 1)]


def scalar_of(source: str, axis: int, out: str) -> list[onnx.NodeProto]:
    """``out`` = Shape(source)[axis] as an int64 scalar."""
    return shape_of(source, axis, out + "_1d") + [
        const(out + "_axes", [0]), node("Squeeze", [out + "_1d", out + "_axes"], out)]


def aranges(q: str = "q", k: str = "k") -> list[onnx.NodeProto]:
    """``i`` [S, 1] and ``j`` [1, T]: query and key positions (from q [B, H, S, D] and
    k [B, H, T, D])."""
    return [*scalar_of(q, 2, "s"), *scalar_of(k, 2, "t"), const("zero", 0), const("one", 1),
            node("Range", ["zero", "s", "one"], "i0"), node("Range", ["zero", "t", "one"], "j0"),
            const("ax1", [1]), const("ax0", [0]),
            node("Unsqueeze", ["i0", "ax1"], "i"), node("Unsqueeze", ["j0", "ax0"], "j")]


def qkv_inputs(s: str = "S", t: str = "S", heads: int = 2, d: int = 8) -> list:
    return [tensor("q", F, ["B", heads, s, d]), tensor("k", F, ["B", heads, t, d]),
            tensor("v", F, ["B", heads, t, d])]
