"""Attention sinks: a learned logit per head that takes part in the Softmax and is then
dropped (GPT-OSS). As exporters write it::

    logits = Concat(scores + mask, sink[1, H, 1, 1] expanded to [B, H, S, 1], axis=-1)
    probs  = Softmax(logits - ReduceMax(logits, axis=-1))[..., :-1]

so every probability is ``exp(s_i) / (sum_j exp(s_j) + exp(sink_h))``: the sink adds to each
row's denominator and nothing to its output. ORT's GroupQueryAttention computes exactly that
with its ``head_sink`` input ([H]); the general form (lower/common.dense_mha) adds one key of
zeros whose bias is the sink, which is the same sum. The max subtracted before the Softmax
changes nothing it computes (the Softmax is shift-invariant and ORT's subtracts the max
itself).

Granite's SWA spells the same sink after the attention: ``softmax(x) @ v * sigmoid(lse(x) -
sink)``, with ``lse`` the logsumexp of each row of ``x``. Since ``sigmoid(lse - s) = sum_j
exp(x_j) / (sum_j exp(x_j) + exp(s))``, that is ``softmax(concat(x, s))[..., :-1] @ v``
exactly: ``SinkScaleAfterAttention`` rewrites it so (Normalise), and the recogniser reads the
column as it reads GPT-OSS's. A row whose keys are all masked gets 0 either way (the column's
exp(s) outweighs them; sigmoid(-inf) is 0).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, pattern

from mha_onnx.rewrite.blocks import PROBS_OPS
from mha_onnx.rewrite.irutil import const_array, const_ints, dims, ints_attr, producer

_LOOK_THROUGH = ("Expand", "Reshape", "Unsqueeze", "Cast", "Identity", "Squeeze")


def drops_last_column(node: ir.Node) -> bool:
    """``Slice(x, starts=[0], ends=[-1], axes=[-1 | rank-1], steps=[1])``: x[..., :-1]."""
    if node.op_type != "Slice" or len(node.inputs) < 4:
        return False
    rank = len(node.inputs[0].shape) if node.inputs[0].shape is not None else None
    starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
    axes = const_ints(node.inputs[3])
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1]
    last = {-1} | ({rank - 1} if rank else set())
    return starts == [0] and ends == [-1] and axes is not None and len(axes) == 1 \
        and axes[0] in last and steps == [1]


def max_shifted(node: ir.Node) -> ir.Value | None:
    """For ``Sub(x, ReduceMax(x, axes=[-1], keepdims=1))``: x; else None."""
    if node.op_type != "Sub":
        return None
    reduce = producer(node.inputs[1], "ReduceMax")
    if reduce is None or reduce.inputs[0] is not node.inputs[0]:
        return None
    axes = const_ints(reduce.inputs[1]) if len(reduce.inputs) > 1 and reduce.inputs[1] \
        else list(reduce.attributes.get_ints("axes", []) or [])
    keep = reduce.attributes.get_int("keepdims", 1)
    return node.inputs[0] if keep == 1 and axes in ([-1], [3]) else None


def sink_concat(node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """For ``Concat(scores, column, axis=-1)`` (rank 4): (scores, column); else None."""
    if node.op_type != "Concat" or len(node.inputs) != 2:
        return None
    if node.attributes.get_int("axis", 0) not in (-1, 3):
        return None
    return node.inputs[0], node.inputs[1]


def sink_values(column: ir.Value, heads: int) -> np.ndarray | None:
    """The [H] logits of a sink column made from a constant of H values (broadcast, reshaped
    or cast on the way); None where it is computed or holds other than one value per head."""
    value = column
    for _ in range(8):
        array = const_array(value)
        if array is not None:
            if array.size != heads:
                return None
            shape = [d for d in array.shape if d != 1]
            return array.reshape(heads) if shape in ([heads], []) else None
        node = producer(value, *_LOOK_THROUGH)
        if node is None:
            return None
        value = node.inputs[0]
    return None


def scaled_sink_rules(found: list[str]) -> list:
    return [SinkScaleAfterAttention.rule(found)]


def _through(value: ir.Value, *op_types: str) -> ir.Value:
    """``value`` above any chain of ``op_types`` nodes that each have one reader."""
    node = producer(value, *op_types)
    while node is not None and len(node.outputs[0].uses()) == 1:
        value = node.inputs[0]
        node = producer(value, *op_types)
    return value


def _axes(node: ir.Node) -> list[int] | None:
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return const_ints(node.inputs[1])
    return ints_attr(node, "axes")


def _private(node: ir.Node | None, op_type: str) -> ir.Node | None:
    """``node`` if it is an ``op_type`` whose one output has one reader."""
    ok = node is not None and node.op_type == op_type and len(node.outputs[0].uses()) == 1
    return node if ok else None


def _scaled_sink(attention: ir.Value, scale: ir.Value
                 ) -> tuple[ir.Value, ir.Value, np.ndarray] | None:
    """(scores, v, [H] sink logits) where ``attention`` is ``MatMul(Softmax(scores), v)`` and
    ``scale`` is ``Unsqueeze(Sigmoid(ReduceLogSumExp(scores) - sink), -1)``; else None."""
    last = ([-1], [3])
    unsqueeze = _private(producer(_through(scale, "Cast")), "Unsqueeze")
    sigmoid = _private(producer(unsqueeze.inputs[0]) if unsqueeze else None, "Sigmoid")
    sub = _private(producer(_through(sigmoid.inputs[0], "Cast")) if sigmoid else None, "Sub")
    lse = _private(producer(sub.inputs[0]) if sub else None, "ReduceLogSumExp")
    matmul = _private(producer(attention), "MatMul")
    softmax = _private(producer(_through(matmul.inputs[0], *PROBS_OPS)) if matmul else None,
                       "Softmax")
    if not (unsqueeze and lse and softmax) or _axes(unsqueeze) not in last \
            or _axes(lse) not in last or lse.attributes.get_int("keepdims", 1) != 0 \
            or softmax.attributes.get_int("axis", -1) not in (-1, 3) \
            or softmax.inputs[0] is not lse.inputs[0]:
        return None
    scores = lse.inputs[0]
    shape = dims(scores)
    if shape is None or len(shape) != 4 or not isinstance(shape[1], int):
        return None
    values = sink_values(sub.inputs[1], shape[1])  # type: ignore[union-attr]
    return None if values is None else (scores, matmul.inputs[1], values)


SCALED_NOTE = ("{n} sink(s) scaling the attention's output by sigmoid(logsumexp - sink) made "
               "a column of the scores (GPT-OSS's form)")


class SinkScaleAfterAttention(pattern.RewriteRuleClassBase):
    """``MatMul(Softmax(x), v) * Unsqueeze(Sigmoid(ReduceLogSumExp(x) - sink), -1)`` ->
    ``MatMul(Softmax(Concat(x, sink column))[..., :-1], v)`` (the module's docstring), the
    Mul's operands in either order, through the Casts exporters write (a float16 export's
    scale in float32; TorchScript's probabilities cast to themselves), axes as an input or
    an attribute (opset 18 or 17)."""

    def __init__(self, found: list[str]) -> None:
        super().__init__("SinkScaleAfterAttention")
        self.found = found
        self._match: tuple[ir.Value, ir.Value, np.ndarray] | None = None

    def pattern(self, op, attention, scale):
        return op.Mul(attention, scale, _outputs=["out"])

    def check(self, context, attention, scale, **_) -> MatchResult:
        result = MatchResult()
        self._match = _scaled_sink(attention, scale) or _scaled_sink(scale, attention)
        return result if self._match is not None else result.fail("not a sink's scale")

    def rewrite(self, op, out, **_):
        scores, v, values = self._match  # type: ignore[misc]
        self.found.append(out.producer().name or "Mul")
        heads = int(values.size)
        dtype = scores.dtype.numpy() if scores.dtype is not None else np.float32
        sink = op.Constant(value=ir.tensor(values.reshape(1, heads, 1, 1).astype(dtype)))
        rows = op.Slice(op.Shape(scores), op.Constant(value_ints=[0]), op.Constant(value_ints=[3]))
        column = op.Expand(sink, op.Concat(rows, op.Constant(value_ints=[1]), axis=0))
        logits = op.Concat(scores, column, axis=-1)
        probs = op.Softmax(logits, axis=-1)
        kept = op.Slice(probs, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]),
                        op.Constant(value_ints=[-1]), op.Constant(value_ints=[1]))
        # (shapes as inference would give them: the recogniser reads the scores' rank)
        wider = ir.Shape([*list(scores.shape)[:3], None])  # type: ignore[union-attr]
        for value, shape in ((logits, wider), (probs, wider), (kept, scores.shape)):
            value.shape, value.dtype = shape, scores.dtype
        result = op.MatMul(kept, v)
        result.shape, result.dtype = out.shape, out.dtype
        return result
