"""Nodes the lowering wrote, spelt as the model's own opset allows.

The forms are written once, at the newest spelling (ReduceMax's axes as an input, Shape's
``start``/``end``), but a fused graph keeps the model's opset: most BERT exports in the world
are TorchScript exports at opset 14-17, where ``ReduceMin`` takes its axes as an attribute
(an input only from opset 18) and ``Shape`` has no ``start``/``end`` (from 15). ORT refuses
such a node at load. Raising the model's opset instead would touch every node the exporter
wrote; spelling ours down touches only what changed meaning between the versions.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mha_onnx.errors import FuseBug
from mha_onnx.rewrite.irutil import all_graphs, const_array, opset

# Reductions whose axes moved from an attribute to an input at opset 18 (ReduceSum at 13)
AXES_INPUT_SINCE = {op: 18 for op in (
    "ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")} | {"ReduceSum": 13}
SHAPE_SLICE_SINCE = 15  # Shape's start and end attributes


def fit_to_opset(model: ir.Model) -> int:
    """Every default-domain node of ``model`` (subgraphs included) that uses a spelling newer
    than the model's opset rewritten to the older one; how many were."""
    version = opset(model)
    fitted = 0
    for graph in all_graphs(model.graph):
        for node in list(graph):
            if node.domain not in ("", "ai.onnx"):
                continue
            since = AXES_INPUT_SINCE.get(node.op_type)
            if since is not None and version < since and len(node.inputs) > 1:
                _axes_as_attribute(node)
                fitted += 1
            elif node.op_type == "Shape" and version < SHAPE_SLICE_SINCE and (
                    "start" in node.attributes or "end" in node.attributes):
                _shape_then_slice(graph, node)
                fitted += 1
    return fitted


def _axes_as_attribute(node: ir.Node) -> None:
    """``Reduce*(x, axes)`` -> ``Reduce*(x) <axes=...>`` (the axes must be a constant)."""
    axes_value = node.inputs[1]
    if "noop_with_empty_axes" in node.attributes:
        raise FuseBug(f"{node.name}: {node.op_type} with noop_with_empty_axes has no spelling "
                       f"before its opset {AXES_INPUT_SINCE[node.op_type]}",
                       hint="please report this model")
    if axes_value is not None:
        axes = const_array(axes_value)
        if axes is None:
            raise FuseBug(f"{node.name}: {node.op_type}'s axes are computed, and the model's "
                           f"opset takes them as an attribute only",
                           hint="please report this model")
        if axes.size:
            node.attributes["axes"] = ir.AttrInt64s("axes", [int(a) for a in axes.reshape(-1)])
    node.resize_inputs(1)


def _shape_then_slice(graph: ir.Graph, node: ir.Node) -> None:
    """``Shape(x) <start, end>`` -> ``Slice(Shape(x), [start], [end], [0])`` (the same
    clamping: Slice clamps its bounds to the rank as Shape does)."""
    start = node.attributes.pop("start", None)
    end = node.attributes.pop("end", None)
    whole = node.outputs[0]
    bounds = [start.value if start is not None else 0,
              end.value if end is not None else np.iinfo(np.int64).max, 0]
    consts = [ir.node("Constant", [], {"value": ir.tensor(np.array([b], np.int64))},
                      name=f"{node.name}_{what}")
              for b, what in zip(bounds, ("start", "end", "axis"), strict=True)]
    name, shape = whole.name, whole.shape
    whole.name, whole.shape = f"{name}_whole", ir.Shape([None])  # [rank]
    part = ir.Value(name=name, shape=shape, type=whole.type)
    whole.replace_all_uses_with(part, replace_graph_outputs=True)
    cut = ir.node("Slice", [whole, *(c.outputs[0] for c in consts)], outputs=[part],
                  name=f"{node.name}_slice")
    graph.insert_after(node, [*consts, cut])
