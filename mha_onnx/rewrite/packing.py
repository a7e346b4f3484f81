"""Q, K and V projections packed into one MatMul, for a kernel that reads them packed.

A decode step multiplies one token by each weight matrix: a matrix-vector product whose time
is reading the weights, plus the cost of starting the kernel (waking the thread pool). The
MatMuls that read one input with constant weights are one MatMul over the weights side by
side: the same products (each output column is the same dot product), one kernel start
instead of three, as ORT GenAI's graphs pack QKV. A GroupQueryAttention that rotates Q and K
itself reads the packed tensor whole (rotary.py packs where that is so); a Split gives the
parts to what still reads them separately (a fallback branch: where that Split would run on
every run, as for an MLP's gate and up, packing would only add its copy, so nothing else is
packed).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import const_array


def projections(values: list[ir.Value | None]) -> list[ir.Node] | None:
    """The MatMuls of one graph computing ``values``, one each, when they read one input with
    constant 2-D weights of one dtype. (For opset >= 13, where Split takes its sizes as an
    input: rotary.fold_rotary, the caller, checks it once for the model.)"""
    nodes = [v.producer() if v is not None else None for v in values]
    if any(n is None or _weight(n) is None for n in nodes) or len(nodes) < 2 \
            or len(set(map(id, nodes))) != len(nodes):
        return None
    graph = nodes[0].graph
    if graph is None or any(n.graph is not graph or n.inputs[0] is not nodes[0].inputs[0]
                            or n.inputs[1].dtype != nodes[0].inputs[1].dtype for n in nodes):
        return None
    return nodes


def pack(nodes: list[ir.Node]) -> tuple[ir.Value, dict[str, tuple[str, int, int]]]:
    """``nodes`` (from :func:`projections`) become one MatMul and a Split whose parts replace
    their outputs. Returns the packed output and where each weight went: {its initializer:
    (the packed initializer, first column, end column)} (for the fused model's metadata:
    validate rebuilds its PyTorch reference from the weights)."""
    return _pack(nodes[0].graph, nodes)


def _weight(node: ir.Node) -> np.ndarray | None:
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    weight = const_array(node.inputs[1])
    if weight is None or weight.ndim != 2 or node.inputs[0] is None:
        return None
    return weight


def _pack(graph: ir.Graph, nodes: list[ir.Node]
          ) -> tuple[ir.Value, dict[str, tuple[str, int, int]]]:
    weights = [_weight(node) for node in nodes]
    names = [node.inputs[1].name for node in nodes]
    joined = ir.Value(name=f"{nodes[0].inputs[1].name}_packed{len(nodes)}",
                      const_value=ir.tensor(np.ascontiguousarray(np.concatenate(weights, 1))))
    joined.type = ir.TensorType(ir.DataType.from_numpy(weights[0].dtype))
    joined.shape = ir.Shape(joined.const_value.shape)
    graph.register_initializer(joined)
    sizes = ir.Value(name=f"{joined.name}_sizes",
                     const_value=ir.tensor(np.array([w.shape[1] for w in weights], np.int64)))
    sizes.type, sizes.shape = ir.TensorType(ir.DataType.INT64), ir.Shape([len(weights)])
    graph.register_initializer(sizes)
    first = min(nodes, key=lambda n: list(graph).index(n))  # its input exists before it
    matmul = ir.Node("", "MatMul", [first.inputs[0], joined], name=f"{first.name}_packed")
    split = ir.Node("", "Split", [matmul.outputs[0], sizes], [ir.AttrInt64("axis", -1)],
                    num_outputs=len(nodes), name=f"{first.name}_split")
    matmul.outputs[0].name = f"{joined.name}_out"
    graph.insert_before(first, [matmul, split])  # its input exists there already
    for node, out in zip(nodes, split.outputs, strict=True):
        old = node.outputs[0]
        out.name, out.type, out.shape = f"{old.name}_part", old.type, old.shape
        if old.is_graph_output():  # the graph keeps its output names
            out.name, old.name = old.name, f"{old.name}_unpacked"
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        graph.remove(node, safe=True)
    ends = np.cumsum([w.shape[1] for w in weights]).tolist()
    return matmul.outputs[0], {name: (joined.name, int(end - w.shape[1]), int(end))
                               for name, w, end in zip(names, weights, ends, strict=True)
                               if name}
