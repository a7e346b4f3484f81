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
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import const_array, const_ints, producer

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
