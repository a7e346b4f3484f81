"""Shape facts for graphs that carry none, and two rewrites that read them.

TorchScript exports (Optimum's among them) carry no ``value_info`` and compute reshape targets
with ``Shape -> Gather -> Concat`` chains, which ONNX's own shape inference cannot follow: the
attention blocks' Q, K and V then have no known shapes and no rule can read them. Our own
symbolic inference (graph/symbolic.py) evaluates those chains with symbols and names every
dim, ``past_sequence_length + sequence_length`` included, so that recognition does not
depend on which exporter wrote the graph.
"""

from __future__ import annotations

import logging

import onnx

from mha_onnx.graph.symbolic import infer_shapes
from mha_onnx.rewrite.irutil import dims, producer, shape_bounds

log = logging.getLogger(__name__)


def with_symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every value's symbolic shape that can be read in ``value_info`` (a
    copy; ``If`` branches' values too). Values after a node nothing can read are left
    without one, and fusing goes on with the shapes there are."""
    inferred, unknown = infer_shapes(model)
    if unknown:
        log.info("symbolic shapes: %d value(s) left without one", unknown)
    return inferred


def fold_static_dims(model) -> int:
    """``Slice(Shape(x))`` and ``Gather(Shape(x), i)`` whose selected dims are static become
    constants, so that what is computed from them folds too (GPT-2's and Falcon's
    TorchScript exports scale Q and K by ``sqrt(1 / sqrt(Shape(k)[-1]))``: once constant, the
    scale is read as one). Returns how many were folded."""
    import onnx_ir as ir

    from mha_onnx.rewrite.irutil import all_graphs

    folded = 0
    for graph in all_graphs(model.graph):
        for node in list(graph):
            picked = _picked_dims(node)
            if picked is None or node.outputs[0].is_graph_output():
                continue
            constant = ir.node("Constant", [], {"value": ir.tensor(picked)})
            graph.insert_before(node, constant)
            ir.convenience.replace_all_uses_with(node.outputs[0], constant.outputs[0])
            folded += 1
    return folded


def _picked_dims(node):
    """What ``Slice|Gather(Shape(x), ...)`` gives when every dim it selects is static (an
    int64 array), else None."""
    import numpy as np

    shape_node = producer(node.inputs[0], "Shape") if node.inputs else None
    if shape_node is None or shape_node.inputs[0] is None or shape_node.inputs[0].shape is None:
        return None
    every = [d if isinstance(d, int) else -1 for d in shape_node.inputs[0].shape]
    first, last = shape_bounds(shape_node, len(every))
    read = np.array(every[first:last], np.int64)
    axes = _picked_axes(node, len(read))
    if axes is None:
        return None
    picked = read[axes]
    return None if (picked < 0).any() else np.asarray(picked, np.int64)


def _picked_axes(node, rank: int):
    """Which entries of a shape vector of ``rank`` dims ``Gather(shape, i)`` or ``Slice(shape,
    a, b[, 0, step])`` with constant arguments picks: an int array shaped as its output (0-D
    for a scalar Gather); None for anything else."""
    import numpy as np

    from mha_onnx.rewrite.irutil import const_array

    if node.op_type not in ("Slice", "Gather") or node.domain not in ("", "ai.onnx"):
        return None
    args = [const_array(v) if v is not None else None for v in node.inputs[1:]]
    if not args or any(a is None for a, v in zip(args, node.inputs[1:], strict=True)
                       if v is not None):
        return None
    positions = np.arange(rank)
    try:
        if node.op_type == "Gather":
            return np.take(positions, args[0].astype(np.int64), axis=0)
        starts, ends = args[0], args[1]
        axes = args[2] if len(args) > 2 and args[2] is not None else np.array([0])
        steps = args[3] if len(args) > 3 and args[3] is not None else np.ones_like(starts)
        if starts.size != 1 or list(axes.reshape(-1)) not in ([0], [-1]):
            return None
        return positions[int(starts[0]):int(min(ends[0], 2 ** 62)):int(steps[0])]
    except (IndexError, ValueError):
        return None


def probability_shapes(model) -> int:
    """Dims of a Softmax's output read by ``Shape(probs)`` (whole, or picked by a Gather or
    Slice) are read instead from a graph input with the same symbolic dim, or are
    constants: DeBERTa views its probabilities by their own sizes (``probs.view(-1,
    probs.size(-2), probs.size(-1))``), and fusing cannot remove probabilities something else
    reads. A read with a dim that has no such source is left. Returns how many moved."""
    import onnx_ir as ir

    from mha_onnx.rewrite.irutil import all_graphs

    sources: dict[str, tuple[ir.Value, int]] = {}  # symbol -> (graph input, axis)
    for value in model.graph.inputs:
        for axis, d in enumerate(dims(value) or []):
            if isinstance(d, str):
                sources.setdefault(d, (value, axis))
    moved = 0
    for graph in all_graphs(model.graph):
        for shape_node in list(graph):
            source = shape_node.inputs[0] if shape_node.op_type == "Shape" else None
            shape = dims(source)
            if (producer(source, "Softmax") is None or shape is None
                    or shape_node.outputs[0].is_graph_output()):
                continue
            first, last = shape_bounds(shape_node, len(shape))
            read = shape[first:last]
            if _reread(graph, shape_node, read, sources, False):
                moved += 1  # every dim read elsewhere: the Shape itself replaced
                continue
            for use in list(shape_node.outputs[0].uses()):
                picked = _picked_axes(use.node, len(read))
                if picked is not None and picked.ndim <= 1 and _reread(
                        graph, use.node, [read[a] for a in picked.reshape(-1)], sources,
                        picked.ndim == 0):
                    moved += 1
    return moved


def _reread(graph, node, wanted: list, sources: dict, scalar: bool) -> bool:
    """``node``'s output (a 1-D int64 of the ``wanted`` dims; a scalar if ``scalar``) read
    from constants and graph inputs' dims instead; False (nothing changed) where a dim has
    neither or the output is the graph's."""
    import numpy as np
    import onnx_ir as ir

    if not wanted or node.outputs[0].is_graph_output() or not all(
            isinstance(d, int) or d in sources for d in wanted):
        return False
    parts = [ir.node("Constant", [], {"value": ir.tensor(np.array([d], np.int64))})
             if isinstance(d, int) else ir.node("Shape", [sources[d][0]], {
                 "start": sources[d][1], "end": sources[d][1] + 1}) for d in wanted]
    if len(parts) > 1:
        parts.append(ir.node("Concat", [p.outputs[0] for p in parts], {"axis": 0}))
    if scalar:
        parts.append(ir.node("Squeeze", [parts[-1].outputs[0]]))
    graph.insert_before(node, parts)
    ir.convenience.replace_all_uses_with(node.outputs[0], parts[-1].outputs[0])
    return True
