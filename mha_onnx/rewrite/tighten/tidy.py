"""After lowering: one computation where each layer repeats the same one.

Every lowered block builds its run-time guard (one new token? rows padded?) from its own
tensors: ``Shape`` of its query for the new tokens, ``attention_mask == 0`` with its own
copy of the zero. The results are equal in every layer, but no pass can see it: the shapes
are read from different tensors and the constants are different initializers. Here a
``Shape`` (any start/end) whose dims are, symbol for symbol, a run of a graph input's dims
reads that input instead (the dims are the symbolic shapes the fusion was recognised with;
verification runs the fused graph at many sizes), equal initializers become one, and
common-subexpression elimination then leaves one guard for all layers: a decode step runs
it once, not once per layer.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from mha_onnx.rewrite.irutil import dims, shape_bounds


def share_guards(model: ir.Model) -> int:
    """Shape reads moved onto graph inputs, constants cast like a tensor of known type cast
    to that type (ORT folds a Cast of a constant, not a CastLike whose other input is a
    graph input: it ran on every step), then equal initializers and equal nodes merged;
    returns how many Shape nodes now read a graph input."""
    moved = _shapes_from_inputs(model)
    _constant_casts(model)
    for step in (common_passes.DeduplicateInitializersPass(),
                 common_passes.CommonSubexpressionEliminationPass(),
                 common_passes.RemoveUnusedNodesPass(), common_passes.OutputFixPass()):
        step(model)
    return moved


def _shapes_from_inputs(model: ir.Model) -> int:
    runs = [(value, [d for d in (dims(value) or [])]) for value in model.graph.inputs]
    moved = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type != "Shape" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        source = node.inputs[0]
        shape = dims(source)
        if source is None or source.is_graph_input() or not shape:
            continue
        start, end = shape_bounds(node, len(shape))
        wanted = shape[start:end]
        if not wanted or not all(isinstance(d, str) for d in wanted):
            continue
        for value, have in runs:
            at = _find(have, wanted)
            if at is not None:
                node.replace_input_with(0, value)
                node.attributes["start"] = ir.AttrInt64("start", at)
                node.attributes["end"] = ir.AttrInt64("end", at + len(wanted))
                moved += 1
                break
    return moved


def _constant_casts(model: ir.Model) -> None:
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "CastLike" or node.domain not in ("", "ai.onnx"):
            continue
        source, like = node.inputs[0], node.inputs[1]
        constant = source is not None and (source.const_value is not None or (
            source.producer() is not None and source.producer().op_type == "Constant"))
        if constant and like is not None and like.dtype is not None:
            cast = ir.Node("", "Cast", [source], [ir.AttrInt64("to", like.dtype.value)])
            node.graph.insert_before(node, cast)
            cast.outputs[0].dtype = like.dtype
            ir.convenience.replace_all_uses_with(node.outputs[0], cast.outputs[0],
                                                 replace_graph_outputs=True)
            node.graph.remove(node, safe=True)


def _find(have: list, wanted: list) -> int | None:
    for at in range(len(have) - len(wanted) + 1):
        if have[at:at + len(wanted)] == wanted:
            return at
    return None
