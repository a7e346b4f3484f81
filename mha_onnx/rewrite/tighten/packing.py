"""Q, K and V projections packed into one MatMul, for a kernel that reads them packed.

A decode step multiplies one token by each weight matrix: a matrix-vector product whose time
is reading the weights, plus the cost of starting the kernel (waking the thread pool). The
MatMuls that read one input with constant weights are one MatMul over the weights side by
side: the same products (each output column is the same dot product), one kernel start
instead of three, as ORT GenAI's graphs pack QKV. A GroupQueryAttention that rotates Q and K
itself reads the packed tensor whole (rotary_fold.py packs where that is so); a Split gives the
parts to what still reads them separately (a fallback branch: where that Split would run on
every run, as for an MLP's gate and up, packing would only add its copy, so nothing else is
packed).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import (
    const_array,
    const_ints,
    dims,
    insert_first,
    int_attr,
    ints_attr,
    producer,
)


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
    joined = _initializer(graph, f"{nodes[0].inputs[1].name}_packed{len(nodes)}",
                          np.concatenate(weights, 1))
    sizes = _initializer(graph, f"{joined.name}_sizes",
                         np.array([w.shape[1] for w in weights], np.int64))
    first = min(nodes, key=lambda n: list(graph).index(n))  # its input exists before it
    matmul = ir.Node("", "MatMul", [first.inputs[0], joined], name=f"{first.name}_packed",
                     metadata_props=dict(first.metadata_props))  # (its layer, for quantize)
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


# -- the kernel reading Q, K and V packed ---------------------------------------------------

# (What it saves shows at short lengths, where kernel starts are a large part of a run: see
# docs/history/bench-notebook.md, "Forms tuned on this machine", third run.)

def pack_kernel_inputs(model: ir.Model) -> tuple[int, dict[str, tuple[str, int, int]]]:
    """Every GroupQueryAttention reading Q, K and V as three projections of one input (a
    MatMul with constant weights, perhaps + a constant bias, read by that kernel alone)
    reads one MatMul over the weights side by side instead (+ the biases side by side; a
    projection without one adds zeros): one kernel start instead of three (or six), the
    kernel's packed-QKV input. The model keeps each weight once: what else read the old
    weights (another form's branch) reads a Slice of the packed one, which ORT folds into
    a constant when it loads the model. Returns how many kernels read packed inputs, and where
    packed weights (and biases) went, as pack does."""
    where: dict[str, tuple[str, int, int]] = {}
    joined: dict[tuple[int, ...], tuple[ir.Value, ir.Value | None]] = {}
    slices: list[tuple[ir.Value, ir.Value, tuple[int, int], int]] = []
    kernels = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        whole = _parts_of_one(node)
        if whole is not None:  # (the exporter packed them already: read before its split)
            for i, value in enumerate((whole, None, None)):
                node.replace_input_with(i, value)
            kernels += 1
            continue
        group = _kernel_projections(node)
        if group is None:
            continue
        matmuls, biases = group
        key = tuple(id(v) for v in [m.inputs[1] for m in matmuls] + biases)
        if key not in joined:
            joined[key] = _join(model.graph, matmuls, biases, where, slices)
        weight, bias = joined[key]
        tape = ir.tape.Tape()
        out = tape.op("MatMul", [matmuls[0].inputs[0], weight])
        if bias is not None:
            out = tape.op("Add", [out, bias])
        out.name, out.type = f"{node.name}_qkv", node.inputs[0].type
        graph = matmuls[0].graph
        order = list(graph)
        graph.insert_before(min(matmuls, key=order.index), tape.nodes)
        for i, value in enumerate((out, None, None)):
            node.replace_input_with(i, value)
        kernels += 1
    for old, packed, span, axis in slices:
        _read_slice(model.graph, old, packed, span, axis)
    return kernels, where


def _reads_three(node: ir.Node) -> list[ir.Value] | None:
    """A GroupQueryAttention's Q, K and V where it alone reads them."""
    if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft" \
            or len(node.inputs) < 3 or any(v is None for v in node.inputs[:3]):
        return None
    values = list(node.inputs[:3])
    if any(len(v.uses()) != 1 or v.is_graph_output() for v in values):
        return None
    return values


def _fits(node: ir.Node, widths: list[int]) -> bool:
    """Whether Q, K and V of these widths are what the kernel's packed input holds."""
    heads, groups = (int_attr(node, a, 0) for a in ("num_heads", "kv_num_heads"))
    return heads > 0 and groups > 0 and widths[0] % heads == 0 \
        and widths[1] == widths[2] == widths[0] // heads * groups


def _parts_of_one(node: ir.Node) -> ir.Value | None:
    """The tensor a GroupQueryAttention's Q, K and V are consecutive parts of along the last
    axis (its three Split outputs in order, or three Slices covering it), where the kernel
    alone reads them."""
    values = _reads_three(node)
    if values is None:
        return None
    split = producer(values[0], "Split")
    if split is not None:
        sizes = _split_sizes(split)
        whole = split_source(*values)
        return whole if whole is not None and sizes is not None and _fits(node, sizes) else None
    slices = [producer(v, "Slice") for v in values]
    if any(n is None for n in slices) or len({id(n.inputs[0]) for n in slices}) != 1:
        return None
    whole = slices[0].inputs[0]
    shape, width = dims(whole), _width(whole)
    spans = [_last_axis_span(n, len(shape) if shape else 3) for n in slices]
    if width is None or any(s is None for s in spans):
        return None
    ends = [min(end, width) for _, end in spans]
    starts = [start for start, _ in spans]
    if starts != [0, ends[0], ends[1]] or ends[2] != width:
        return None
    return whole if _fits(node, [ends[0], ends[1] - ends[0], ends[2] - ends[1]]) else None


def _width(value: ir.Value) -> int | None:
    """The last dim of ``value``: from its shape, or from the weight of the MatMul making it."""
    shape = dims(value)
    if shape and isinstance(shape[-1], int):
        return shape[-1]
    matmul = producer(value, "MatMul")
    weight = _weight(matmul) if matmul is not None else None
    return None if weight is None else int(weight.shape[1])


def split_source(q: ir.Value, k: ir.Value, v: ir.Value | None) -> ir.Value | None:
    """The tensor Q, K and V are the three outputs of one Split of, in order, along the last
    axis of a [B, S, width] tensor (pack's output, or the exporter's own), if they are."""
    split = producer(q, "Split")
    if (split is None or v is None or list(split.outputs) != [q, k, v]
            or int_attr(split, "axis", 0) not in (-1, 2)):
        return None
    return split.inputs[0]


def _split_sizes(split: ir.Node) -> list[int] | None:
    """The widths of a Split's outputs, where they are constants."""
    if len(split.inputs) > 1 and split.inputs[1] is not None:
        return const_ints(split.inputs[1])
    sizes = ints_attr(split, "split")
    if sizes:
        return sizes
    width = _width(split.inputs[0])
    if width is not None and width % len(split.outputs) == 0:
        return [width // len(split.outputs)] * len(split.outputs)
    return None


def _last_axis_span(node: ir.Node, rank: int) -> tuple[int, int] | None:
    """(start, end) of a Slice over the last axis alone, step 1, constant bounds."""
    bounds = [const_ints(v) if v is not None else None for v in node.inputs[1:5]]
    starts, ends = bounds[0], bounds[1]
    axes = bounds[2] if len(bounds) > 2 and bounds[2] is not None else None
    steps = bounds[3] if len(bounds) > 3 and bounds[3] is not None else [1]
    if starts is None or ends is None or len(starts) != 1 or steps != [1] or rank < 1 \
            or (axes is not None and axes[0] not in (-1, rank - 1)) \
            or (axes is None and rank != 1) or starts[0] < 0 or ends[0] < 0:
        return None
    return starts[0], ends[0]


def _kernel_projections(node: ir.Node
                        ) -> tuple[list[ir.Node], list[ir.Value | None]] | None:
    """(the three MatMuls, their biases or None) where ``node`` is a GroupQueryAttention
    whose Q, K and V are that, read by it alone, and of widths the packed input can hold."""
    values = _reads_three(node)
    if values is None:
        return None
    matmuls, biases, widths = [], [], []
    for value in values:
        add, bias = producer(value, "Add"), None
        if add is not None:
            for a, b in ((0, 1), (1, 0)):
                found = const_array(add.inputs[b])
                if found is not None and found.ndim == 1:
                    value, bias = add.inputs[a], add.inputs[b]
                    break
            if bias is None or len(value.uses()) != 1:
                return None
        matmul = producer(value, "MatMul")
        weight = _weight(matmul) if matmul is not None else None
        if weight is None or (bias is not None and const_array(bias).shape[0] != weight.shape[1]):
            return None
        matmuls.append(matmul)
        biases.append(bias)
        widths.append(weight.shape[1])
    if projections([m.outputs[0] for m in matmuls]) is None:
        return None
    return (matmuls, biases) if _fits(node, widths) else None


def _join(root: ir.Graph, matmuls: list[ir.Node], biases: list[ir.Value | None],
          where: dict[str, tuple[str, int, int]],
          slices: list[tuple[ir.Value, ir.Value, tuple[int, int], int]]
          ) -> tuple[ir.Value, ir.Value | None]:
    """The packed weight (and bias) as initializers of the main graph; in ``slices``, each
    old one with the part of the packed one that replaces it."""
    weights = [m.inputs[1] for m in matmuls]
    arrays = [_weight(m) for m in matmuls]
    weight = _initializer(root, f"{weights[0].name}_qkv", np.concatenate(arrays, 1))
    ends = np.cumsum([a.shape[1] for a in arrays]).tolist()
    spans = [(int(end - a.shape[1]), int(end)) for a, end in zip(arrays, ends, strict=True)]
    bias = None
    if any(b is not None for b in biases):
        parts = [const_array(b) if b is not None else np.zeros(a.shape[1], a.dtype)
                 for b, a in zip(biases, arrays, strict=True)]
        bias = _initializer(root, f"{weights[0].name}_qkv_bias",
                            np.concatenate(parts).astype(arrays[0].dtype))
    for n, (w, b) in enumerate(zip(weights, biases, strict=True)):
        for old, packed, axis in ((w, weight, 1), (b, bias, 0)):
            if old is None or packed is None:
                continue
            if old.name:
                where[old.name] = (packed.name or "", *spans[n])
            slices.append((old, packed, spans[n], axis))
    return weight, bias


def _initializer(root: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    while name in root.initializers:
        name += "_"
    value = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(array)))
    value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
    value.shape = ir.Shape(array.shape)
    root.register_initializer(value)
    return value


def _read_slice(root: ir.Graph, old: ir.Value, packed: ir.Value, span: tuple[int, int],
                axis: int) -> None:
    """What still reads ``old`` reads Slice(``packed``) over ``span`` of ``axis`` instead
    (dead readers included: the unused-node pass drops them and the Slice with them);
    ``old`` leaves the initializers."""
    if not old.uses():
        return
    tape = ir.tape.Tape()
    bounds = [tape.op("Constant", [], {"value": ir.tensor(np.array([v], np.int64))})
              for v in (span[0], span[1], axis)]
    part = tape.op("Slice", [packed, *bounds])
    part.name, part.type, part.shape = f"{old.name}_part", old.type, old.shape
    insert_first(root, tape.nodes)
    ir.convenience.replace_all_uses_with(old, part)
    if old.name in root.initializers and root.initializers[old.name] is old:
        root.initializers.pop(old.name)
