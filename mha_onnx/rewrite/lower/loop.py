"""Key padding as a ``Loop`` over the batch: each entry ``Compress``es its padded keys away
and runs the unmasked MultiHeadAttention on the kept ones (linear memory, no masked work); an
entry whose keys are all padded gets exactly what the original graph gives there (NaN, zeros,
the mean of V, or the softmax of the scores plus a finite fill)."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import MS_DOMAIN
from mha_onnx.rewrite.lower.common import (
    TapeOps,
    mean_over_keys,
    name_values,
    safe_name,
    scalar_shape,
)
from mha_onnx.rewrite.sdpa import SdpaInfo, seq_dim


def padding_loop(op, info: SdpaInfo, q3: ir.Value, k: ir.Value, v: ir.Value,
                 is_3d: bool) -> ir.Value:
    """for b in batch: MHA(q[b], K[b][keep[b]], V[b][keep[b]]); special rows as the original.
    ``k``/``v``: [B, T, H*D] when ``is_3d``, else [B, H, T, D]."""
    assert info.padded is not None
    t_axis = 1 if is_3d else 2
    ops = TapeOps()
    i = ir.val("b", ir.DataType.INT64, ir.Shape([]))
    cond_in = ir.val("cond_in", ir.DataType.BOOL, ir.Shape([]))
    axis0 = ops.Constant(value_ints=[0])
    start = ops.Unsqueeze(i, axis0)
    stop = ops.Add(start, ops.Constant(value_ints=[1]))
    q_b, k_b, v_b = (ops.Slice(x, start, stop, axis0) for x in (q3, k, v))
    keep = ops.Not(ops.Squeeze(ops.Slice(info.padded, start, stop, axis0), axis0))
    kept = ops.ReduceSum(ops.Cast(keep, to=ir.DataType.INT64), keepdims=0)
    any_kept = ops.Greater(kept, ops.Constant(value=ir.tensor(np.array(0, np.int64))))

    then = TapeOps()
    attn = then.MultiHeadAttention(q_b, then.Compress(k_b, keep, axis=t_axis),
                                   then.Compress(v_b, keep, axis=t_axis), _domain=MS_DOMAIN,
                                   num_heads=info.heads, scale=info.scale)
    other = TapeOps()
    other_out = _all_padded(other, info, q_b, k_b, v_b, is_3d, t_axis)
    out_b = ops.If(any_kept,
                   then_branch=ir.Graph([], [attn], nodes=then.tape.nodes, name="keys_kept"),
                   else_branch=ir.Graph([], [other_out], nodes=other.tape.nodes,
                                        name="all_keys_padded"))
    cond_out = ops.Identity(cond_in)
    for value in (attn, other_out, out_b):  # subgraph outputs need their type declared
        value.dtype = info.query.dtype
    cond_out.dtype = ir.DataType.BOOL
    body = ir.Graph([i, cond_in], [cond_out, out_b], nodes=ops.tape.nodes, name="per_batch")
    name_values(body, f"{safe_name(info.block)}_loop")
    trip = op.Reshape(seq_dim(op, q3, 0), scalar_shape(op))
    stacked = op.Loop(trip, op.Constant(value=ir.tensor(np.array(True))), body=body)
    stacked.dtype = info.query.dtype  # [B, 1, S, H*Dv]
    return op.Squeeze(stacked, op.Constant(value_ints=[1]))


def _all_padded(ops: TapeOps, info: SdpaInfo, q_b, k_b, v_b, is_3d: bool, t_axis: int) -> ir.Value:
    """What the original graph computes for a batch entry whose keys are all padded."""
    width = info.heads * info.dv
    rows = ops.Shape(q_b, start=1, end=2)
    out_shape = ops.Concat(ops.Constant(value_ints=[1]), rows, ops.Constant(value_ints=[width]),
                           axis=0)
    dtype = info.np_dtype
    if info.fill == -math.inf:  # softmax of all -inf is NaN; a NaN guard makes it 0
        fill = 0.0 if info.nan_to_zero else math.nan
        return ops.Expand(ops.Constant(value=ir.tensor(np.array(fill, dtype))), out_shape)
    if info.all_masked_value() == "mean":  # every score equals the fill: uniform weights
        mean = mean_over_keys(ops, v_b, t_axis)  # [1, 1, H*Dv] or [1, H, 1, Dv]
        if not is_3d:
            mean = ops.Reshape(ops.Transpose(mean, perm=[0, 2, 1, 3]),
                               ops.Constant(value_ints=[1, 1, width]))
        return ops.Expand(mean, out_shape)
    # additive finite fill: softmax(s + fill) over all keys, as the original computes it
    keys = ops.Shape(k_b, start=t_axis, end=t_axis + 1)
    bias_shape = ops.Concat(ops.Constant(value_ints=[1, 1]), rows, keys, axis=0)
    bias = ops.Expand(ops.Constant(value=ir.tensor(np.array(info.fill, dtype))), bias_shape)
    return ops.MultiHeadAttention(q_b, k_b, v_b, None, None, bias, _domain=MS_DOMAIN,
                                  num_heads=info.heads, scale=info.scale)
