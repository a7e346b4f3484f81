"""Causal attention onto ``com.microsoft.GroupQueryAttention``, wherever that is exact.

GQA runs causal attention in linear memory with grouped K/V (``kv_num_heads``), a sliding
window (``local_window_size``: each query keeps its last ``window`` keys), logit soft-capping
(``softcap``), an additive ``attention_bias`` and per-row key counts (``seqlens_k``):

- causal self-attention: one GQA node;
- causal + key padding: GQA with ``seqlens_k`` is exact when every row's padded keys are a
  suffix (right padding) and no query is left with no key; an ``If`` checks that at run time
  and otherwise takes the general form (MultiHeadAttention + the original mask as a bias,
  whose producers are copied into that branch so they run only there);
- causal with S != T, top-left aligned (PyTorch's ``is_causal``): when S <= T no query sees a
  key beyond S, so GQA runs on the first S keys; otherwise the general form (an ``If`` again).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.forms import UNPADDED, Form, either
from mha_onnx.rewrite.irutil import BLOCK, MS_DOMAIN, STEP, dims
from mha_onnx.rewrite.lower.common import (
    TapeOps,
    branch,
    dense_mha,
    general_kernel,
    int_const,
    kernel_extras,
    name_values,
    none_padded,
    safe_name,
    scalar_shape,
)
from mha_onnx.rewrite.sdpa import SdpaInfo, seq_dim, to_bsd


def gqa_shapes_ok(info: SdpaInfo) -> bool:
    """GQA's own limits: one head size for K and V, a multiple of 8; heads grouped evenly. A
    V narrower than K (DeepSeek's MLA) is padded with zeros to K's head size and the output
    cut back (gqa_call): the zero columns add nothing to the columns kept."""
    return info.dk >= info.dv and info.dk % 8 == 0 and info.heads % info.kv_heads == 0


def gqa_ok(info: SdpaInfo) -> bool:
    """Can GQA compute this causal block exactly (possibly behind a run-time check)?"""
    if not info.causal or not gqa_shapes_ok(info):
        return False
    if info.alignment == "square":
        return True
    # top-left with S != T: only plain causal (the key slice would not fit the other inputs)
    return (info.alignment == "top-left" and not info.window and info.padded is None
            and info.bias is None)


def _total_length(op, k3: ir.Value) -> ir.Value:
    """T as an int32 scalar (GQA's total_sequence_length)."""
    return op.Cast(op.Reshape(seq_dim(op, k3, 1), scalar_shape(op)), to=ir.DataType.INT32)


def gqa_call(op, info: SdpaInfo, q3, k3, v3, seqlens=None, total=None, *,
             causal: bool = True) -> ir.Value:
    """One GroupQueryAttention node on [B, S, H*D] / [B, T, G*D] inputs; without ``seqlens``
    every row keeps all T keys. ``causal=False``: bidirectional (key padding by seqlens_k)."""
    if total is None:
        total = _total_length(op, k3)
    if seqlens is None:
        seqlens = op.Expand(op.Sub(total, int_const(op, 1, np.int32)), seq_dim(op, q3, 0))
    attrs: dict[str, object] = {"num_heads": info.heads, "kv_num_heads": info.kv_heads,
                                "scale": info.scale}
    if not causal:
        attrs["causal"] = 0
    elif info.window:
        attrs["local_window_size"] = info.window
    if info.softcap:
        attrs["softcap"] = info.softcap
    bias = info.bias
    if bias is not None and (dims(bias) is None or dims(bias)[2] in (1, None)):
        # GQA takes [B|1, H|1, S, T]: a bias the same for every query (ALiBi) is spread
        rows = op.Concat(int_const(op, [1, 1]), seq_dim(op, q3, 1), int_const(op, [1]), axis=0)
        bias = op.Expand(bias, rows)
    narrow = info.dv < info.dk
    if narrow:  # [B, T, G*Dv] -> [B, T, G*Dk], each head's columns past Dv zero
        heads_v = op.Reshape(v3, int_const(op, [0, 0, info.kv_heads, info.dv]))
        pads = int_const(op, [0, 0, 0, 0, 0, 0, 0, info.dk - info.dv])
        v3 = op.Reshape(op.Pad(heads_v, pads), int_const(op, [0, 0, info.kv_heads * info.dk]))
    inputs = [q3, k3, v3, None, None, seqlens, total, None, None, None, bias, info.sink]
    while inputs[-1] is None:
        inputs.pop()
    out = op.GroupQueryAttention(*inputs, _domain=MS_DOMAIN, _outputs=3, **attrs)[0]
    out.producer().meta[BLOCK] = info.block
    if narrow:  # each head's first Dv columns: the attention over the original V
        heads_out = op.Reshape(out, int_const(op, [0, 0, info.heads, info.dk]))
        kept = op.Slice(heads_out, int_const(op, [0]), int_const(op, [info.dv]),
                        int_const(op, [3]))
        out = op.Reshape(kept, int_const(op, [0, 0, info.heads * info.dv]))
    return out


def gqa_with_past(op, info: SdpaInfo, q3, k3, v3, past_key, past_value, seqlens, total,
                  bias: ir.Value | None = None, *, step: bool = False
                  ) -> tuple[ir.Value, ir.Value, ir.Value]:
    """One GroupQueryAttention node with a past (appended, or a shared buffer): (out,
    present_key, present_value); the block's window and soft-cap, ``bias`` [B, 1, 1, T]
    the padded keys' additive mask. ``step``: only one-token runs reach it (its guard says
    so; rotary_fold.py then needs no check of a prompt's positions)."""
    assert info.dk == info.dv, info.block  # (the cache's head size is V's: no padding here)
    inputs = [q3, k3, v3, past_key, past_value, seqlens, total, None, None, None, bias,
              info.sink]  # (head_sink: rewrite/recognise/attention_sinks.py)
    while inputs[-1] is None:
        inputs.pop()
    outs = tuple(op.GroupQueryAttention(
        *inputs, num_heads=info.heads, kv_num_heads=info.kv_heads, scale=info.scale,
        local_window_size=info.window or None, softcap=info.softcap or None,
        _domain=MS_DOMAIN, _outputs=3))
    outs[0].producer().meta[BLOCK] = info.block
    outs[0].producer().meta[STEP] = step
    return outs


def lower_gqa(op, info: SdpaInfo, q3: ir.Value, *, right_padded: bool
              ) -> tuple[ir.Value, Form]:
    """The causal block on GQA (behind a run-time check where GQA's exactness needs one).
    ``right_padded``: padded batches take GQA with seqlens_k where they are right-padded;
    False: only unpadded ones (the policy's right_padded_prompt_on_gqa says which)."""
    k3, v3 = to_bsd(op, info.key, info.kv_heads), to_bsd(op, info.value, info.kv_heads)
    label = "GroupQueryAttention (causal"
    label += f", {info.kv_heads} kv heads" if info.kv_heads != info.heads else ""
    label += kernel_extras(info) + ")"
    general = general_kernel(info)
    if info.alignment == "top-left":
        out, form = _top_left(op, info, q3, k3, v3), either("S <= T", label, "MHA + causal bias")
    elif info.padded is None:
        out, form = gqa_call(op, info, q3, k3, v3), Form(label)
    elif not right_padded:
        out, form = _unpadded(op, info, q3, k3, v3), either(
            "no key padded", label, general, cases=(UNPADDED,))
    else:
        out, form = _right_padded(op, info, q3, k3, v3), either("right padding", label, general)
    return out, dataclasses.replace(form, reach=info.window)


def half_precision(info: SdpaInfo) -> bool:
    """The block computes in float16 or bfloat16 (what the policy's padded_rows_on_gqa
    vetoes, and why, is said there)."""
    return info.query.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def if_forms(op, info: SdpaInfo, cond: ir.Value, then, otherwise, tag: str, outputs: int = 1):
    """If(cond) then ``then(ops)`` else ``otherwise(ops)``, each built in its own branch
    (``outputs`` > 1: both return that many values, and so does the If)."""
    dtype = info.query.dtype
    then_graph = branch(f"{tag}_fast", then, dtype)
    else_graph = branch(f"{tag}_general", otherwise, dtype)
    for graph in (then_graph, else_graph):
        name_values(graph, f"{safe_name(info.block)}_{graph.name}")
    out = op.If(cond, then_branch=then_graph, else_branch=else_graph, _outputs=outputs)
    for value in out if outputs > 1 else [out]:
        value.dtype = dtype
    return out


def right_padding(op, info: SdpaInfo, q3, k3) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(cond, seqlens_k, total): cond is True when every row's padded keys are a suffix and
    every query keeps a key (within the window, if any); seqlens_k = kept keys - 1.

    Few ops, as this runs on every call, also at shapes where the whole layer takes tens of
    microseconds: with ``m`` the padded mask as 0/1, a row is right-padded iff no padded key
    is followed by a kept one (``max(m[:, :-1] - m[:, 1:]) <= 0``); its first key is then kept
    iff ``m[:, 0] == 0``; both are one ReduceMax over their concatenation."""
    assert info.padded is not None
    m = op.Cast(info.padded, to=ir.DataType.INT32)  # [B, T], 1 = padded
    axis = op.Constant(value_ints=[1])
    zero, one, end = (op.Constant(value_ints=[v]) for v in (0, 1, -1))
    steps = op.Sub(op.Slice(m, zero, end, axis), op.Slice(m, one, op.Constant(
        value_ints=[np.iinfo(np.int64).max]), axis))  # 1 where a padded key precedes a kept one
    worst = op.ReduceMax(op.Concat(steps, op.Slice(m, zero, one, axis), axis=1), keepdims=0)
    total = _total_length(op, k3)
    lens = op.Sub(total, op.ReduceSum(m, axis, keepdims=0))  # kept keys per row, [B]
    cond = op.Less(worst, int_const(op, 1, np.int32))
    if info.causal and info.window:  # GQA slides a padded query's window from the row's
        # last kept key, the original from the query's own position: they agree while the
        # window covers every query (S <= window) or when no row is padded
        seq_q = op.Cast(op.Reshape(seq_dim(op, q3, 1), scalar_shape(op)), to=ir.DataType.INT32)
        unpadded = op.Equal(op.ReduceMin(lens, keepdims=0), total)
        cond = op.And(cond, op.Or(op.LessOrEqual(seq_q, int_const(op, info.window, np.int32)),
                                  unpadded))
    return cond, op.Sub(lens, int_const(op, 1, np.int32)), total


def _right_padded(op, info: SdpaInfo, q3, k3, v3) -> ir.Value:
    """If every row is right-padded (and no query loses all its keys): GQA with seqlens_k."""
    cond, seqlens, total = right_padding(op, info, q3, k3)

    def fast(ops: TapeOps) -> ir.Value:
        return gqa_call(ops, info, q3, k3, v3, seqlens, total)

    def general(ops: TapeOps) -> ir.Value:
        return dense_mha(ops, info, q3, lazy=True)

    return if_forms(op, info, cond, fast, general, "right_padded")


def _unpadded(op, info: SdpaInfo, q3, k3, v3) -> ir.Value:
    """If no key of any row is padded: GQA on every key; else the general form."""
    return if_forms(op, info, none_padded(op, info), lambda ops: gqa_call(ops, info, q3, k3, v3),
                    lambda ops: dense_mha(ops, info, q3, lazy=True), "unpadded")


def key_padding_gqa(op, info: SdpaInfo, q3, otherwise, max_keys: int | None = None) -> ir.Value:
    """Key padding on bidirectional GQA with seqlens_k when every row is right-padded (the
    whole batch in one kernel call, padded keys skipped) and, if ``max_keys`` is given, there
    are at most that many keys; ``otherwise(ops)`` builds the form for the other cases."""
    k3, v3 = to_bsd(op, info.key, info.kv_heads), to_bsd(op, info.value, info.kv_heads)
    cond, seqlens, total = right_padding(op, info, q3, k3)
    if max_keys is not None:
        cond = op.And(cond, op.LessOrEqual(total, int_const(op, max_keys, np.int32)))

    def fast(ops: TapeOps) -> ir.Value:
        return gqa_call(ops, info, q3, k3, v3, seqlens, total, causal=False)

    return if_forms(op, info, cond, fast, otherwise, "right_padded")


def _top_left(op, info: SdpaInfo, q3, k3, v3) -> ir.Value:
    """Top-left causal with S != T: GQA on the first S keys when S <= T."""
    seq_q, seq_kv = seq_dim(op, q3, 1), seq_dim(op, k3, 1)
    cond = op.Reshape(op.LessOrEqual(seq_q, seq_kv), scalar_shape(op))

    def fast(ops: TapeOps) -> ir.Value:
        start, axis = ops.Constant(value_ints=[0]), ops.Constant(value_ints=[1])
        k_s = ops.Slice(k3, start, seq_q, axis)
        v_s = ops.Slice(v3, start, seq_q, axis)
        return gqa_call(ops, info, q3, k_s, v_s)

    def general(ops: TapeOps) -> ir.Value:
        return dense_mha(ops, info, q3, lazy=True)

    return if_forms(op, info, cond, fast, general, "top_left")
