"""Causal attention aligned to the end of the keys: a layer with a KV cache, whose keys are
the past ones with the new ones appended.

At run time an ``If`` picks the form:

- one new token (a decode step): it sees every key, so the mask is gone. When the keys are
  ``Concat(past_key, new_key)`` and that Concat is also the model's ``present`` output, the
  step is ONNX Runtime's attention with past: ``MultiHeadAttention`` (or, for grouped K/V,
  ``GroupQueryAttention``) takes ``past_key``/``past_value`` and returns the presents itself,
  so the graph's Concat moves into the other branch and a step no longer copies the cache
  once for the Concat and reads it again for the attention
  (``tools/experiments/kv_forms.py`` measures the forms). Otherwise one unmasked MultiHeadAttention over the concatenated cache;
- no past (the prompt, S == T): plain causal self-attention, onto GroupQueryAttention as any
  other (with key padding behind its right-padding check);
- new tokens after a past (chunked prefill): MultiHeadAttention with the original mask.

Where the stage-2 rule matched the layer's appended caches (lowered.present_caches), the
presents come out of the If and the rule returns them in place of the Concats.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.forms import LEFT_PADDED, NO_PAST, ONE_TOKEN, UNPADDED, Form, either
from mha_onnx.rewrite.irutil import MS_DOMAIN
from mha_onnx.rewrite.lower.common import (
    TapeOps,
    dense_mha,
    fix_all_padded,
    general_kernel,
    int_const,
    kernel_extras,
    kv_operands,
    new_key_kept,
    none_padded,
    padding_bias,
    scalar_shape,
)
from mha_onnx.rewrite.lower.gqa import (
    gqa_ok,
    gqa_with_past,
    half_precision,
    if_forms,
    lower_gqa,
)
from mha_onnx.rewrite.lower.lowered import Appended, Caches, Lowered
from mha_onnx.rewrite.lower.shared import lower_shared, shareable
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.sdpa import SdpaInfo, seq_dim, to_bsd


def cached_ok(info: SdpaInfo) -> bool:
    """Causal aligned to the end of the keys; a position bias (BLOOM's ALiBi, T5's relative
    bias) is added by every form: attention_bias of the kernel with past, of GQA for the
    prompt, the dense bias otherwise."""
    return info.causal and info.alignment == "bottom-right"


def _gqa_only(info: SdpaInfo) -> bool:
    """A sliding window, a soft-cap or sinks: only GQA computes it (MHA with past does not;
    the other forms take the dense mask, sinks as a key of zeros)."""
    return bool(info.window or info.softcap) or info.sink is not None


def _decode(ops: TapeOps, info: SdpaInfo, q3: ir.Value) -> ir.Value:
    """One query over the whole (concatenated) cache: nothing of the causal mask applies
    (but a window, a soft-cap or a position bias: then the original mask as a bias)."""
    if _gqa_only(info) or info.bias is not None:
        return dense_mha(ops, info, q3, lazy=True)
    k, v, _ = kv_operands(ops, info)  # (as [B, T, H*D] where V's head size is not K's)
    return _mha(ops, info, q3, k, v)[0]


def _mha(ops: TapeOps, info: SdpaInfo, q3, k, v, past_k=None, past_v=None) -> list[ir.Value]:
    """MultiHeadAttention without a mask but key padding and the position bias (if any);
    with past: (out, presents)."""
    keep = None if info.padded is None else ops.Cast(ops.Not(info.padded), to=ir.DataType.INT32)
    inputs = [q3, k, v, None, keep, info.bias, past_k, past_v]
    while inputs[-1] is None:
        inputs.pop()
    outs = ops.MultiHeadAttention(*inputs, num_heads=info.heads, scale=info.scale,
                                  _domain=MS_DOMAIN, _outputs=3 if past_k is not None else 1)
    outs = list(outs) if past_k is not None else [outs]
    if info.padded is not None:
        outs[0] = fix_all_padded(ops, info, outs[0], outs[2] if past_v is not None else v, False)
    return outs


def _decode_with_past(ops: TapeOps, info: SdpaInfo, q3, key: Appended, value: Appended,
                      bias: ir.Value | None = None):
    """The step on the kernel's own past/present: (out, present_key, present_value);
    ``bias`` [B, 1, 1, T] (GQA only): the padded keys' additive mask (the block's position
    bias is added to it)."""
    k3, v3 = to_bsd(ops, key.new, info.kv_heads), to_bsd(ops, value.new, info.kv_heads)
    if info.kv_heads == info.heads and bias is None and not _gqa_only(info):
        return tuple(_mha(ops, info, q3, k3, v3, key.past, value.past))
    if info.bias is not None:
        bias = info.bias if bias is None else ops.Add(bias, info.bias)
    past = ops.Cast(ops.Reshape(seq_dim(ops, key.past, 2), scalar_shape(ops)),
                    to=ir.DataType.INT32)
    total = ops.Add(past, ops.Cast(ops.Reshape(seq_dim(ops, k3, 1), scalar_shape(ops)),
                                   to=ir.DataType.INT32))
    seqlens = ops.Expand(ops.Sub(total, int_const(ops, 1, np.int32)), seq_dim(ops, q3, 0))
    return gqa_with_past(ops, info, q3, k3, v3, key.past, value.past, seqlens, total, bias,
                         step=True)  # (both callers: under `decoding`)


def _prefill(ops: TapeOps, info: SdpaInfo, q3: ir.Value,
             fresh: tuple[ir.Value, ir.Value] | None = None) -> ir.Value:
    """S > 1: without past the causal mask is square (GQA); with past, the original mask.
    ``fresh``: the new keys and values alone, which are the whole of an appended cache
    where there is no past: the prompt's kernel reads them, not Concat(empty past, new)
    (so that nothing lies between it and the exporter's rotation: rotary_fold.py folds it)."""
    square = dataclasses.replace(info, alignment="square")
    if not gqa_ok(square):
        return dense_mha(ops, info, q3, lazy=True)
    seq_q, seq_kv = seq_dim(ops, q3, 1), seq_dim(ops, info.key, 2)
    no_past = ops.Reshape(ops.Equal(seq_q, seq_kv), scalar_shape(ops))
    prompt = square if fresh is None else dataclasses.replace(square, key=fresh[0],
                                                              value=fresh[1])
    right_padded = FormPolicy.padded_rows_on_gqa(half_precision(info))
    return if_forms(ops, info, no_past,
                    lambda o: lower_gqa(o, prompt, q3, right_padded=right_padded)[0],
                    lambda o: dense_mha(o, info, q3, lazy=True), "prompt")


def _prefill_appending(ops: TapeOps, info: SdpaInfo, q3, key: Appended, value: Appended):
    """The other branch when the presents come out of the If: the Concats are made here."""
    k, v = key.rebuilt(ops), value.rebuilt(ops)
    return _prefill(ops, dataclasses.replace(info, key=k, value=v), q3,
                    (key.new, value.new)), k, v


def lower_cached(op, info: SdpaInfo, q3: ir.Value, cache: Caches | None,
                 policy: FormPolicy) -> Lowered:
    """``cache``: the layer's appended caches where the rule returns the presents (else the
    form reads the keys as they are); ``policy.kv_cache``: appended (the presents are the
    pasts with the new keys appended) or shared (max-length buffers, see lower/shared.py; where a
    layer's caches are not plain model inputs and outputs it stays appended, which fuse
    then refuses)."""
    if policy.kv_cache == "shared" and cache is not None and shareable(*cache) \
            and info.bias is None and info.sink is None:  # (the shared forms add no position
        # bias; with sinks, GQA on a shared buffer read 0.13 off the original's logits for a
        # prompt past GPT-OSS's window, where the appended form is exact)
        return lower_shared(op, info, q3, *cache)
    decoding = op.Reshape(op.Equal(seq_dim(op, q3, 1), int_const(op, [1])), scalar_shape(op))
    rest = either("no past", f"GroupQueryAttention (causal{kernel_extras(info)})",
                  general_kernel(info), cases=(NO_PAST,), reach=info.window) \
        if gqa_ok(dataclasses.replace(info, alignment="square")) \
        else Form(general_kernel(info))  # (as _prefill chooses)
    if cache is not None and info.padded is not None \
            and (info.kv_heads != info.heads or _gqa_only(info)):
        return _grouped_padded(op, info, q3, cache, decoding, rest)
    if cache is not None:
        outs = if_forms(op, info, decoding, lambda o: _decode_with_past(o, info, q3, *cache),
                        lambda o: _prefill_appending(o, info, q3, *cache), "decode", outputs=3)
        kernel = "MultiHeadAttention" if info.kv_heads == info.heads and not _gqa_only(info) \
            else "GroupQueryAttention"
        added = " + attention_bias" if info.bias is not None else ""
        form = either("one new token", f"{kernel} with past{added}"
                      f"{kernel_extras(info, bias=False)} (presents from it)", rest,
                      cases=(ONE_TOKEN,))
        return Lowered(outs[0], form, cache, (outs[1], outs[2]))
    out = if_forms(op, info, decoding, lambda o: _decode(o, info, q3),
                   lambda o: _prefill(o, info, q3), "decode")
    head = "MHA key_padding_mask" if info.padded is not None else "MultiHeadAttention"
    return Lowered(out, either("one new token", f"{head} over the cache", rest,
                               cases=(ONE_TOKEN,)))


def _grouped_padded(op, info: SdpaInfo, q3, cache: Caches, decoding, rest: Form
                    ) -> Lowered:
    """Grouped K/V with a key padding mask: MHA with past takes no grouped K/V, so a step
    whose new token every row keeps runs GQA with past and the padding as an additive bias
    (no key padded: a zero bias); other runs take MHA over the cache's heads repeated.
    Half precision: GQA only when no key is padded (FormPolicy.padded_rows_on_gqa)."""
    half = not FormPolicy.padded_rows_on_gqa(half_precision(info))
    fast = op.And(decoding, none_padded(op, info) if half else new_key_kept(op, info))

    def padded(ops: TapeOps):
        k, v = (c.rebuilt(ops) for c in cache)
        wide = dataclasses.replace(info, key=k, value=v)
        out = if_forms(ops, wide, decoding, lambda o: _decode(o, wide, q3),
                       lambda o: _prefill(o, wide, q3, (cache[0].new, cache[1].new)),
                       "padded")
        return out, k, v

    def step(ops: TapeOps):
        return _decode_with_past(ops, info, q3, *cache,
                                 bias=None if half else padding_bias(ops, info))

    outs = if_forms(op, info, fast, step, padded, "decode", outputs=3)
    over = general_kernel(info) if _gqa_only(info) else "MHA key_padding_mask"
    padded = either("one new token", f"{over} over the cache", rest, cases=(ONE_TOKEN,),
                    reach=info.window)
    extra = kernel_extras(info)
    if half:
        form = either("one new token, no key padded",
                      f"GroupQueryAttention with past{extra} (presents from it)",
                      padded, cases=(ONE_TOKEN, UNPADDED))
    else:
        form = either("one new token, kept in every row",
                      f"GroupQueryAttention with past + padding bias{extra} (presents "
                      "from it)", padded, cases=(ONE_TOKEN, LEFT_PADDED))
    return Lowered(outs[0], form, cache, (outs[1], outs[2]))
