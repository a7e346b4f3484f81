"""RMS normalisation onto ORT's kernels: ``SimplifiedLayerNormalization`` (and, with the
residual Add before it, ``com.microsoft.SkipSimplifiedLayerNormalization``), as ORT GenAI's
builder writes a Llama layer.

Hugging Face's ``x * rsqrt(mean(x^2) + eps) * weight`` reaches ONNX as
``Mul(weight, Cast(Mul(x, Div(1, Sqrt(Add(ReduceMean(Pow(x, 2)), eps))))))`` from the
TorchScript exporter (Optimum) and with ``Reciprocal`` instead of ``Div(1, .)`` elsewhere;
onnxscript's own rule and ORT's session-level fusion expect other spellings, so in a decode
step these ~9 small ops per norm are dispatched one by one. One rule per spelling; the
weight must be a constant vector over the last axis and the mean over that axis only.
"""

from __future__ import annotations

from typing import Any

import onnx
import onnx.numpy_helper
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet, pattern

from mha_onnx.graph.walk import all_graphs, attr
from mha_onnx.rewrite.irutil import MS_DOMAIN, const_array, const_scalar, dims


class RmsNorm(pattern.RewriteRuleClassBase):
    """``weight * cast(x * 1/sqrt(mean(x^2, -1) + eps))`` -> SimplifiedLayerNormalization."""

    def __init__(self, reciprocal: bool, cast: bool) -> None:
        super().__init__(f"RmsNorm{'Reciprocal' if reciprocal else 'Div'}{'Cast' if cast else ''}")
        self.reciprocal, self.cast = reciprocal, cast

    def pattern(self, op, x, axes, eps, one, two, weight):
        mean = op.ReduceMean(op.Pow(x, two), axes, _allow_other_attributes=True)
        root = op.Sqrt(op.Add(mean, eps))
        inverse = op.Reciprocal(root) if self.reciprocal else op.Div(one, root)
        normed = op.Mul(x, inverse)
        if self.cast:
            normed = op.Cast(normed, _allow_other_attributes=True)
        return op.Mul(weight, normed)

    def check(self, context, x, axes, eps, one, two, weight, **_) -> MatchResult:
        result = MatchResult()
        shape, w = dims(x), const_array(weight)
        if const_scalar(two) != 2.0 or (not self.reciprocal and const_scalar(one) != 1.0):
            return result.fail("not a mean of squares under a reciprocal square root")
        if const_scalar(eps) is None or shape is None:
            return result.fail("epsilon not constant or the input's rank unknown")
        reduced = const_array(axes)
        if reduced is None or [int(a) % len(shape) for a in reduced.reshape(-1)] != [len(shape) - 1]:
            return result.fail("the mean is not over the last axis alone")
        if w is None or w.ndim != 1 or w.shape[0] != shape[-1]:
            return result.fail("the weight is not a constant vector over the last axis")
        if _before_upcast(x, weight).dtype != weight.dtype:
            return result.fail("the input and the weight differ in type")
        return result

    def rewrite(self, op, x, eps, weight, **_):
        source = _before_upcast(x, weight)
        return op.SimplifiedLayerNormalization(source, weight, axis=-1,
                                               epsilon=float(const_scalar(eps)), stash_type=1)


class SkipRmsNorm(pattern.RewriteRuleClassBase):
    """``SimplifiedLayerNormalization(a + b)`` whose sum is also used (the residual stream)
    -> SkipSimplifiedLayerNormalization, which returns both."""

    def __init__(self) -> None:
        super().__init__("SkipRmsNorm")

    def pattern(self, op, a, b, weight):
        total = op.Add(a, b)
        normed = op.SimplifiedLayerNormalization(total, weight, _allow_other_attributes=True,
                                                 _outputs=["normed"])
        return normed, total

    def check(self, context, a, b, normed, **_) -> MatchResult:
        result = MatchResult()
        da, db = dims(a), dims(b)
        if da is None or db is None or da != db or len(da) != 3:
            return result.fail("the residual Add broadcasts or is not [B, S, D]")
        if a.dtype != b.dtype or a.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return result.fail("operands of different or unsupported types")
        return result

    def rewrite(self, op, a, b, weight, normed, **_):
        attrs: dict[str, Any] = {"epsilon": normed.producer().attributes["epsilon"].as_float()}
        outs = op.SkipSimplifiedLayerNormalization(a, b, weight, _domain=MS_DOMAIN,
                                                   _outputs=4, **attrs)
        return outs[0], outs[3]  # the normalised value, the residual sum


def _before_upcast(x: ir.Value, weight: ir.Value) -> ir.Value:
    """The norm's input before a Cast up to float32, when the weight has that type (the
    kernel computes in float32 itself: stash_type=1)."""
    cast = x.producer()
    if cast is not None and cast.op_type == "Cast" and cast.inputs[0] is not None \
            and cast.inputs[0].dtype == weight.dtype:
        return cast.inputs[0]
    return x


def fuse_norms(model: ir.Model) -> int:
    """RMSNorm and residual + RMSNorm onto ORT's kernels; the number of nodes rewritten."""
    rules = [RmsNorm.rule(r, c) for r in (False, True) for c in (True, False)]
    count = RewriteRuleSet(rules).apply_to_model(model)
    count += RewriteRuleSet([SkipRmsNorm.rule()]).apply_to_model(model)
    return count


# Outputs of the norm kernels nothing needs (the mean and 1/std a training graph would
# read): named, ORT's CPU kernel writes them, ~3 us of a 20 us SkipSimplifiedLayerNorm call
# at a decode step; unnamed, as ORT GenAI's graph leaves them, it does not. (Run last: a
# name fix would name them again.)
_OPTIONAL = {"SimplifiedLayerNormalization": (1,), "SkipSimplifiedLayerNormalization": (1, 2)}


def omit_unread_outputs(graph: ir.Graph) -> None:
    """The norm kernels' optional outputs nothing reads left unnamed (not computed)."""
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for index in _OPTIONAL.get(node.op_type, ()):
            if index < len(node.outputs):
                value = node.outputs[index]
                if not value.uses() and not value.is_graph_output():
                    value.name = ""


def residual_sums(model: ir.Model) -> int:
    """The residual ``Add`` that only a float32 LayerNormalization reads written as ``Sum``,
    for the CPU: ONNX Runtime fuses such an ``Add -> LayerNormalization`` into
    SkipLayerNormalization wherever both operands have one known 3-D shape (so in a fused
    graph, whose attention kernels give their outputs shapes, and not in the TorchScript
    original, which has none), and its CPU kernel runs 1.5-5.5x slower than the two ops it
    replaces in float32 (ORT 1.31, 2 threads: 0.96 against 0.18 ms at [1, 512, 768], 0.037
    against 0.011 ms at [8, 1, 1024]; ``python -m tools.experiments.skip_norm``, docs/history/bench-notebook.md).
    It matches Add only. Returns how many."""
    count = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        add = node.inputs[0].producer() if node.inputs[0] is not None else None
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or (
                (add.outputs[0].dtype or add.inputs[0].dtype) not in (ir.DataType.FLOAT,
                                                                      ir.DataType.DOUBLE)
                or add.outputs[0].is_graph_output() or len(add.outputs[0].uses()) != 1):
            continue  # (a sum read elsewhere too ORT does not fuse: Add is the faster op)
        total = ir.Node("", "Sum", list(add.inputs), name=f"{add.name}_sum" if add.name else None)
        total.outputs[0].name = f"{add.outputs[0].name}_sum"
        total.outputs[0].type, total.outputs[0].shape = add.outputs[0].type, add.outputs[0].shape
        add.graph.insert_before(add, total)
        ir.convenience.replace_all_uses_with(add.outputs[0], total.outputs[0])
        add.graph.remove(add, safe=True)
        count += 1
    return count


def unguarded_norms(model: onnx.ModelProto) -> list[str]:
    """Square roots of a mean of squares with nothing added (``Sqrt(ReduceMean(Pow(x, 2)))``):
    an RMS normalisation whose epsilon is gone (torch.onnx's optimizer drops one <= 1e-8 as
    zero), so a row of zeros gives 0 * inf = NaN. The nodes' names, every graph searched."""
    found = []
    for graph in all_graphs(model.graph):
        made = {out: node for node in graph.node for out in node.output}
        weights = {t.name: t for t in graph.initializer}
        for node in graph.node:
            mean = made.get(node.input[0]) if node.op_type == "Sqrt" else None
            if mean is None or mean.op_type != "ReduceMean":
                continue
            square = made.get(mean.input[0])
            if square is None:
                continue
            squared = (square.op_type == "Mul" and square.input[0] == square.input[1]) or (
                square.op_type == "Pow" and _scalar(square.input[1], weights, made) == 2.0)
            if squared:
                found.append(node.name or node.output[0])
    return found


def _scalar(name: str, weights: dict[str, onnx.TensorProto],
            made: dict[str, onnx.NodeProto]) -> float | None:
    """The value of a one-element initializer or Constant, else None."""
    tensor = weights.get(name)
    if tensor is None and name in made and made[name].op_type == "Constant":
        tensor = attr(made[name], "value")
    array = onnx.numpy_helper.to_array(tensor) if tensor is not None else None
    return float(array.reshape(())) if array is not None and array.size == 1 else None


