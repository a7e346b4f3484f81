"""``fuse --kv-cache shared`` with per-row lengths, as ONNX Runtime GenAI runs a batch:
each row of a cache buffer holds that row's kept (unpadded) keys first, so a batch whose
rows are left- or right-padded stays on GroupQueryAttention over one shared buffer
(``seqlens_k`` = the row's kept keys - 1, read from the model's key padding mask).

The buffer's layout, row by row (``b``), for ``n_b`` kept positions among the ``P`` cached
ones: positions ``[0, n_b)`` hold the kept keys in order; a step writes its ``S`` new
positions at ``[n_b, n_b + S)``, its kept ones first, then its padded ones (in order), so a
later step overwrites the padded ones. The padding mask's cached part must stay what it was
when those positions were written (as in every generation loop).

At run time an ``If`` picks the form:

- one new token, kept in every row (a decode step): GQA with per-row ``seqlens_k``;
- a prompt (no past) whose rows each keep one run of positions (left, right or no
  padding, at least one kept): the rows gathered kept-first (one ``Gather`` per Q, K, V and
  one back), GQA on that as right padding; queries before a row's first kept key (left
  padding) get what the original gives them, computed from its mask's rows (only when a
  row is left-padded);
- a chunk after a past in one row whose new positions are all kept (a prompt run in
  chunks, as ``serve --prefill-chunk`` runs it; ORT's CPU GQA takes no batch > 1 there):
  GQA after the row's kept keys (with a window or in half precision: no key padded);
- otherwise: the cache's kept keys put back at their logical positions (and the padded ones
  behind them), the original mask as a dense bias over past ++ new, and the new positions
  written at ``[n_b, n_b + S)``: exact, not fast.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.forms import (
    CHUNK,
    LEFT_PADDED,
    NO_PAST,
    ONE_TOKEN,
    UNPADDED,
    Form,
    either,
)
from mha_onnx.rewrite.forms import SHARED as SHARED_RUN
from mha_onnx.rewrite.irutil import const_scalar
from mha_onnx.rewrite.lower.common import (
    TapeOps,
    absorbed_mean,
    clone_into,
    dense_mha,
    fully_masked_value,
    general_kernel,
    int_const,
    kernel_extras,
    new_key_kept,
    none_padded,
    scalar_shape,
)
from mha_onnx.rewrite.lower.gqa import gqa_with_past, half_precision, if_forms
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.recognise.masks import ABSORBING
from mha_onnx.rewrite.sdpa import SdpaInfo, repeat_heads, seq_dim, to_bsd


@dataclasses.dataclass(frozen=True)
class RowSource:
    """The model input the key padding is read from: ``input`` [B, T], a key padded where
    it is 0 (``zero_is_padded``, Hugging Face's attention_mask) or where it is not."""

    input: str
    zero_is_padded: bool

    def to_dict(self) -> dict[str, object]:
        return {"input": self.input, "zero_is_padded": self.zero_is_padded}


def row_source(padded: ir.Value | None) -> RowSource | None:
    """Which [B, T] model input ``padded`` (bool, True = padded key) is, and its polarity:
    the input itself, Not of it, or (Not of) Equal(input, 0), through Casts."""
    if padded is None:
        return None
    negated, value = False, padded
    node = value.producer()
    if node is not None and node.op_type == "Not":
        negated, value = True, node.inputs[0]
        node = value.producer()
    zero_test = False
    if node is not None and node.op_type == "Equal":
        a, b = node.inputs
        zero = b.producer().inputs[0] if b.producer() is not None \
            and b.producer().op_type == "CastLike" else b
        if const_scalar(zero) != 0.0:
            return None
        zero_test, value = True, a
    while value.producer() is not None and value.producer().op_type == "Cast":
        value = value.producer().inputs[0]
    if not value.is_graph_input() or value.shape is None or len(value.shape) != 2:
        return None
    # padded = (x == 0) ^ negated when zero_test; else padded = bool(x) ^ negated
    return RowSource(value.name, zero_is_padded=zero_test != negated)


def lower_rows(op, info: SdpaInfo, q3: ir.Value, key, value, past: ir.Value
               ) -> tuple[list[ir.Value], Form]:
    """(out, present_key, present_value) and the form; ``past``: the cached positions (the
    model's int64 ``past_sequence_length``)."""
    assert info.padded is not None
    narrow = not FormPolicy.padded_rows_on_gqa(half_precision(info))  # (prompts unpadded)
    keep = op.Cast(op.Not(info.padded), to=ir.DataType.INT32)  # [B, T], 1 = kept
    total = op.Cast(op.Reshape(seq_dim(op, info.padded, 1), scalar_shape(op)),
                    to=ir.DataType.INT32)
    one = int_const(op, 1, np.int32)
    seqlens = op.Sub(op.ReduceSum(keep, int_const(op, [1]), keepdims=0), one)
    new32 = op.Cast(op.Reshape(seq_dim(op, q3, 1), scalar_shape(op)), to=ir.DataType.INT32)
    decoding = op.And(op.Equal(new32, one), new_key_kept(op, info))
    if info.window:  # the kernel's window counts a row's kept keys, the original's positions
        decoding = op.And(decoding, _window_unbroken(op, keep, info.window))
    k3, v3 = to_bsd(op, key.new, info.kv_heads), to_bsd(op, value.new, info.kv_heads)

    def gqa(ops: TapeOps):
        return gqa_with_past(ops, info, q3, k3, v3, key.past, value.past, seqlens, total,
                             step=True)  # under `decoding`

    def prompt_or_general(ops: TapeOps):
        cond = ops.And(ops.Equal(ops.Reshape(past, scalar_shape(ops)), int_const(ops, 0)),
                       _one_run_per_row(ops, keep))
        if narrow:  # (FormPolicy.padded_rows_on_gqa: no seqlens_k below the total)
            cond = ops.And(cond, none_padded(ops, info))
        elif info.window and info.softcap:  # ORT 1.31's GQA with both gives a padded query
            # past the window other scores than the original's (without the cap it agrees)
            cond = ops.And(cond, ops.Or(ops.LessOrEqual(new32, int_const(ops, info.window,
                                                                        np.int32)),
                                        none_padded(ops, info)))
        return if_forms(ops, info, cond,
                        lambda o: _prompt(o, info, q3, k3, v3, key, value, keep, seqlens),
                        chunk_or_general, "rows_prompt", outputs=3)

    def chunk_or_general(ops: TapeOps):
        cond = _one_row_keeps_new(ops, keep, past)
        if narrow or info.window:  # (a window counts kept keys: none padded, none skipped)
            cond = ops.And(cond, none_padded(ops, info))
        return if_forms(ops, info, cond,
                        lambda o: gqa_with_past(o, info, q3, k3, v3, key.past, value.past,
                                                seqlens, total),
                        lambda o: _general(o, info, q3, key, value, keep, past),
                        "rows_chunk", outputs=3)

    outs = if_forms(op, info, decoding, gqa, prompt_or_general, "rows", outputs=3)
    return list(outs), _rows_form(info, narrow)


def _rows_form(info: SdpaInfo, narrow: bool) -> Form:
    """What lower_rows' Ifs choose from, as a Form (``narrow``: prompts on GQA unpadded)."""
    guard = "no past, no key padded" if narrow else \
        "no past, one run of kept keys per row" + (
            ", within the window or no key padded" if info.window and info.softcap else "")
    chunk = either("one row, every new position kept" + (
        ", no key padded" if narrow or info.window else ""),
        "GroupQueryAttention after the row's kept keys",
        f"{general_kernel(info)} over the cache's kept keys", cases=(CHUNK,))
    prompt = either(guard, "GroupQueryAttention on rows gathered kept-first", chunk,
                    cases=(NO_PAST, UNPADDED) if narrow
                    or (info.window and info.softcap) else (NO_PAST,))
    step = "one new token, kept in every row" + (
        ", no padding inside the window" if info.window else "")
    return either(step, "GroupQueryAttention on a shared cache buffer (per-row "
                  f"lengths{kernel_extras(info)})", prompt,
                  cases=(SHARED_RUN, ONE_TOKEN, LEFT_PADDED), reach=info.window)


def _one_row_keeps_new(ops, keep: ir.Value, past: ir.Value) -> ir.Value:
    """bool scalar: one row (ORT's CPU GQA takes a chunk after a past at batch 1 only), and
    it keeps every new position (so each new query sees its row's kept past and the new
    keys up to itself, as GQA's causal count over the row's kept keys gives it)."""
    one = int_const(ops, 1)
    single = ops.Equal(ops.Reshape(seq_dim(ops, keep, 0), scalar_shape(ops)), one)
    new = ops.Slice(keep, ops.Reshape(past, int_const(ops, [1])), int_const(ops, [2 ** 62]),
                    int_const(ops, [1]))
    return ops.And(single, ops.Equal(ops.ReduceMin(new, keepdims=0),
                                     int_const(ops, 1, np.int32)))


def _window_unbroken(ops, keep: ir.Value, window: int) -> ir.Value:
    """bool scalar: in every row, the keys the window spans (the last ``window``
    positions) are the row's last ``window`` kept keys (or all of them, where it keeps
    fewer): a window over kept keys, as the kernel counts it, is then the original's window
    over positions. True for left-padded rows and for rows whose padding lies before the
    window (a right-padded prompt ``window`` steps later)."""
    axis = int_const(ops, [1])
    recent = ops.ReduceSum(ops.Slice(keep, int_const(ops, [-window]), int_const(ops, [2 ** 62]),
                                     axis), axis, keepdims=0)
    kept = ops.ReduceSum(keep, axis, keepdims=0)
    same = ops.Equal(recent, ops.Min(kept, int_const(ops, window, np.int32)))
    broken = ops.ReduceMax(ops.Cast(ops.Not(same), to=ir.DataType.INT32), keepdims=0)
    return ops.Equal(broken, int_const(ops, 0, np.int32))


def _one_run_per_row(ops, keep: ir.Value) -> ir.Value:
    """bool scalar: every row keeps exactly one run of consecutive positions (so at least
    one): its kept positions start once."""
    axis = int_const(ops, [1])
    first = ops.Slice(keep, int_const(ops, [0]), int_const(ops, [1]), axis)
    before = ops.Concat(ops.Sub(first, first), ops.Slice(keep, int_const(ops, [0]),
                                                         int_const(ops, [-1]), axis), axis=1)
    starts = ops.ReduceSum(ops.Cast(ops.Greater(keep, before), to=ir.DataType.INT32),
                           int_const(ops, [1]), keepdims=0)
    one = int_const(ops, 1, np.int32)
    return ops.And(ops.Equal(ops.ReduceMin(starts, keepdims=0), one),
                   ops.Equal(ops.ReduceMax(starts, keepdims=0), one))


def kept_first(ops, keep: ir.Value) -> ir.Value:
    """int64 [B, L]: where each position goes when a row is ordered kept-first (stable)."""
    axis = int_const(ops, 1)
    kept_rank = ops.CumSum(keep, axis)
    padded = ops.Sub(int_const(ops, 1, np.int32), keep)
    kept = ops.ReduceSum(keep, int_const(ops, [1]), keepdims=1)
    padded_rank = ops.Add(kept, ops.CumSum(padded, axis))
    dest = ops.Where(ops.Cast(keep, to=ir.DataType.BOOL), kept_rank, padded_rank)
    return ops.Cast(ops.Sub(dest, int_const(ops, 1, np.int32)), to=ir.DataType.INT64)


def inverse(ops, dest: ir.Value) -> ir.Value:
    """The gather indices of the permutation ``dest`` [B, L] (src[b, dest[b, i]] = i)."""
    positions = ops.Expand(ops.Unsqueeze(_arange(ops, seq_dim(ops, dest, 1)),
                                         int_const(ops, [0])), ops.Shape(dest))
    return ops.ScatterElements(positions, dest, positions, axis=1)


def _arange(ops, n: ir.Value) -> ir.Value:
    return ops.Range(int_const(ops, 0), ops.Reshape(n, scalar_shape(ops)), int_const(ops, 1))


def gather_rows(ops, x3: ir.Value, index: ir.Value) -> ir.Value:
    """[B, L, C] x int64 [B, M] -> [B, M, C]: out[b, m] = x[b, index[b, m]] (one Gather on
    the batch-flattened rows)."""
    length = seq_dim(ops, x3, 1)
    offsets = ops.Unsqueeze(ops.Mul(_arange(ops, seq_dim(ops, x3, 0)), length),
                            int_const(ops, [1]))
    flat = ops.Reshape(x3, ops.Concat(int_const(ops, [-1]), ops.Shape(x3, start=2), axis=0))
    return ops.Gather(flat, ops.Add(index, offsets), axis=0)


def gather_cache(ops, x4: ir.Value, index: ir.Value) -> ir.Value:
    """[B, G, L, D] x int64 [B, M] -> [B, G, M, D] along the sequence axis."""
    rows = ops.Transpose(x4, perm=[0, 2, 1, 3])  # [B, L, G, D]
    return ops.Transpose(gather_rows(ops, rows, index), perm=[0, 2, 1, 3])


def _prompt(ops, info: SdpaInfo, q3, k3, v3, key, value, keep, seqlens):
    """No past: every row gathered kept-first, GQA as right padding, and back."""
    dest = kept_first(ops, keep)
    src = inverse(ops, dest)
    total = ops.Cast(ops.Reshape(seq_dim(ops, q3, 1), scalar_shape(ops)), to=ir.DataType.INT32)
    out, present_key, present_value = gqa_with_past(
        ops, info, gather_rows(ops, q3, src), gather_rows(ops, k3, src),
        gather_rows(ops, v3, src), key.past, value.past, seqlens, total)
    out = gather_rows(ops, out, dest)
    unseen = ops.Equal(ops.CumSum(keep, int_const(ops, 1)), int_const(ops, 0, np.int32))
    mode = info.all_masked_value()
    if mode in ("nan", "zero") or (mode == "mean" and info.mask_terms == 1):
        # every score -inf (a constant), or one mask term whose fill every key gets once
        # (uniform weights: the mean of V)
        special = fully_masked_value(ops, info, value.new, 2)
        if mode == "mean":  # [B, G, 1, D] -> [B, 1, H*D]
            wide = repeat_heads(ops, special, info.heads // info.kv_heads)
            special = ops.Reshape(ops.Transpose(wide, perm=[0, 2, 1, 3]),
                                  int_const(ops, [0, 1, -1]))
        return (ops.Where(ops.Unsqueeze(unseen, int_const(ops, [2])), special, out),
                present_key, present_value)
    most = ops.ReduceMax(ops.ReduceSum(ops.Cast(unseen, to=ir.DataType.INT64),
                                       int_const(ops, [1]), keepdims=0), keepdims=1)  # [1]
    out = if_forms(ops, info, ops.Greater(ops.Reshape(most, scalar_shape(ops)), int_const(ops, 0)),
                   lambda o: _unseen_queries(o, info, q3, key.new, value.new, unseen, most, out),
                   lambda o: o.Identity(out), "rows_unseen")
    return out, present_key, present_value


def _unseen_queries(ops, info: SdpaInfo, q3, k, v, unseen, most, out):
    """``out`` [B, S, H*Dv] with the queries before their row's first kept key (left padding)
    as the original computes them, over the first ``most`` query rows, where the mask has
    more than one term or a finite fill. What a query with every key masked gets then
    depends on how the terms add up (GPT-Neo replaces causally hidden scores by the fill and
    then adds its padding mask, which makes them -inf and leaves the padded keys up to the
    query at the fill: a mean over those, not over every key), so it is computed from the
    original mask's rows: where the fill absorbs the scores, the mean of V over
    each row's highest-masked keys (:func:`absorbed_mean`); else (a finite fill, a sink)
    MultiHeadAttention with the original mask on those rows."""
    axis, zero = int_const(ops, [1]), int_const(ops, [0])
    dense = ops.Slice(clone_into(ops, info.dense), zero, most, int_const(ops, [2]))
    if info.sink is None and info.fill <= ABSORBING:
        first = ops.Reshape(ops.Transpose(absorbed_mean(ops, info, dense, v), perm=[0, 2, 1, 3]),
                            int_const(ops, [0, 0, -1]))
    else:
        first = dense_mha(ops, dataclasses.replace(info, key=k, value=v, dense=dense),
                          ops.Slice(q3, zero, most, axis), lazy=False)
    mine = ops.Unsqueeze(ops.Slice(unseen, zero, most, axis), int_const(ops, [2]))
    return ops.Concat(ops.Where(mine, first, ops.Slice(out, zero, most, axis)),
                      ops.Slice(out, most, int_const(ops, [2 ** 62]), axis), axis=1)


def _general(ops, info: SdpaInfo, q3, key, value, keep, past):
    """The exact form at any shape: the logical past rebuilt from the buffer, attention with
    the original mask over past ++ new, the new positions written after the kept ones."""
    cached = ops.Reshape(past, int_const(ops, [1]))
    axis = int_const(ops, [1])
    keep_past = ops.Slice(keep, int_const(ops, [0]), cached, axis)
    keep_new = ops.Slice(keep, cached, int_const(ops, [2 ** 62]), axis)
    kept = ops.Cast(ops.ReduceSum(keep_past, axis, keepdims=1), to=ir.DataType.INT64)  # [B, 1]
    new_src = inverse(ops, kept_first(ops, keep_new))
    logical, buffers = [], []
    for cache in (key, value):
        window = ops.Slice(cache.past, int_const(ops, [0]), cached, int_const(ops, [2]))
        logical.append(cache.rebuilt(ops, gather_cache(ops, window, kept_first(ops, keep_past))))
        buffers.append(_written(ops, cache.past, gather_cache(ops, cache.new, new_src), kept))
    wide = dataclasses.replace(info, key=logical[0], value=logical[1])
    return dense_mha(ops, wide, q3, lazy=True), buffers[0], buffers[1]


def _written(ops, buffer: ir.Value, new: ir.Value, kept: ir.Value) -> ir.Value:
    """``buffer`` [B, G, C, D] with ``new`` [B, G, S, D] written at [kept_b, kept_b + S) of
    each row b (``kept`` int64 [B, 1])."""
    capacity, count = seq_dim(ops, buffer, 2), seq_dim(ops, new, 2)
    position = ops.Unsqueeze(_arange(ops, capacity), int_const(ops, [0]))  # [1, C]
    offset = ops.Sub(position, kept)  # [B, C]: position - kept_b
    inside = ops.And(ops.GreaterOrEqual(offset, int_const(ops, 0)), ops.Less(offset, count))
    index = ops.Where(inside, ops.Add(offset, capacity), ops.Expand(position, ops.Shape(offset)))
    return gather_cache(ops, ops.Concat(buffer, new, axis=2), index)
