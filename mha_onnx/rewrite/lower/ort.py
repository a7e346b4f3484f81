"""Stage 2 for ``--target ort``: each Sdpa becomes the ONNX Runtime contrib kernel that runs
it fastest, in a form that keeps ORT's fast path (measured, see docs/fusion-forms.md). The
kernels are the rows of ``LOWERINGS`` (the first that takes a block lowers it); the forms the
user may pick are the policy's (policy.py). By default:

- no mask: MultiHeadAttention on [B, S, H*D] inputs (ORT's CPU flash path);
- causal (with grouped K/V, a window, soft-capping, key padding or a position bias):
  GroupQueryAttention, see :mod:`mha_onnx.rewrite.lower.gqa`;
- key padding: chosen by shape at run time (``_key_padding``): bidirectional
  GroupQueryAttention for right-padded self-attention up to GQA_MAX_KEYS keys, else MHA's
  key_padding_mask below LOOP_MIN_KEYS keys, else a Loop over the batch that drops the
  padded keys (:mod:`mha_onnx.rewrite.lower.loop`);
- a KV cache (causal aligned to the end of the keys): :mod:`mha_onnx.rewrite.lower.cached`;
- any other mask: MultiHeadAttention with the original mask as an additive attention_bias.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.forms import Form, either
from mha_onnx.rewrite.irutil import MS_DOMAIN
from mha_onnx.rewrite.lower.cached import cached_ok, lower_cached
from mha_onnx.rewrite.lower.common import (
    causal_bias,
    dense_mha,
    fix_all_padded,
    kv_operands,
    scalar_shape,
)
from mha_onnx.rewrite.lower.gqa import (
    gqa_ok,
    gqa_shapes_ok,
    half_precision,
    key_padding_gqa,
    lower_gqa,
)
from mha_onnx.rewrite.lower.loop import padding_loop
from mha_onnx.rewrite.lower.lowered import Caches, Lowered
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.sdpa import (
    SdpaInfo,
    seq_dim,
    to_bsd,
)


def _mha(op, q3, k, v, info: SdpaInfo, bias: ir.Value | None = None) -> ir.Value:
    inputs = [q3, k, v] + ([None, None, bias] if bias is not None else [])
    return op.MultiHeadAttention(*inputs, num_heads=info.heads, scale=info.scale,
                                 _domain=MS_DOMAIN)


@dataclass(frozen=True)
class Lowering:
    """A kernel a block can be lowered onto: ``takes`` says which blocks under a policy,
    ``lower(op, info, q3, policy, cache)`` builds it and returns what it made (lowered.py)."""

    kernel: str
    takes: Callable[[SdpaInfo, FormPolicy], bool]
    lower: Callable[..., Lowered]


def lower_ort(op, node: ir.Node, policy: FormPolicy = FormPolicy(), cache: Caches | None = None
              ) -> Lowered:
    """One Sdpa node onto its kernel, the first of LOWERINGS that takes it: the fused
    [B, S, H*Dv] output and the form used; ``cache``: the layer's appended caches, whose
    presents the lowering returns (lowered.py)."""
    info = SdpaInfo.of(node)
    q3 = to_bsd(op, info.query, info.heads)
    return lowering_for(info, policy).lower(op, info, q3, policy, cache)


def lowering_for(info: SdpaInfo, policy: FormPolicy) -> Lowering:
    return next(each for each in LOWERINGS if each.takes(info, policy))


def _on_gqa(info: SdpaInfo, policy: FormPolicy) -> bool:
    return info.causal and gqa_ok(info) \
        and policy.gqa_for(softcap=bool(info.softcap) or info.sink is not None,
                           window=bool(info.window))


def takes_presents(info: SdpaInfo, policy: FormPolicy) -> bool:
    """Whether the block runs on a kernel with past and present (lower/cached.py), so that
    given its appended caches it returns the presents."""
    return not _on_gqa(info, policy) and policy.cached_on_kernel() and cached_ok(info)


def _plain_causal(info: SdpaInfo, policy: FormPolicy) -> bool:
    return info.mask_kind == "causal" and info.padded is None and info.bias is None \
        and not info.window


def _gqa(op, info: SdpaInfo, q3: ir.Value, policy: FormPolicy, cache) -> Lowered:
    return Lowered(*lower_gqa(op, info, q3, right_padded=policy.right_padded_prompt_on_gqa(
        half_precision(info))))


def _cached(op, info: SdpaInfo, q3: ir.Value, policy: FormPolicy, cache) -> Lowered:
    return lower_cached(op, info, q3, cache, policy)


def _sinks(op, info: SdpaInfo, q3: ir.Value, policy: FormPolicy, cache) -> Lowered:
    return Lowered(dense_mha(op, info, q3, lazy=False),
                   Form("MultiHeadAttention + attention_bias, sinks as a key of zeros"))


def _plain(op, info: SdpaInfo, q3: ir.Value, policy: FormPolicy, cache) -> Lowered:
    k, v, _ = kv_operands(op, info)
    return Lowered(_mha(op, q3, k, v, info), Form("MultiHeadAttention"))


def _dense(op, info: SdpaInfo, q3: ir.Value, policy: FormPolicy, cache) -> Lowered:
    return Lowered(dense_mha(op, info, q3, lazy=False), Form("MultiHeadAttention + attention_bias"))


def _causal_mha(op, info: SdpaInfo, q3: ir.Value, forms: FormPolicy, cache=None) -> Lowered:
    k, v, k3d = kv_operands(op, info)
    if forms.causal == "unidirectional" and info.alignment == "square":
        out = op.MultiHeadAttention(q3, k, v, num_heads=info.heads, scale=info.scale,
                                    unidirectional=1, _domain=MS_DOMAIN)
        return Lowered(out, Form("MultiHeadAttention (unidirectional)"))
    if info.alignment == "bottom-right":
        return _dense(op, info, q3, forms, cache)
    bias = causal_bias(op, info, seq_dim(op, q3, 1), seq_dim(op, k, 1 if k3d else 2))
    return Lowered(_mha(op, q3, k, v, info, bias), Form("MultiHeadAttention + causal bias"))


def _key_padding(op, info: SdpaInfo, q3: ir.Value, forms: FormPolicy, cache=None) -> Lowered:
    """The key padding form: fixed by ``forms``, or (auto) chosen at run time by shape and
    padding, from measurements (docs/fusion-forms.md): bidirectional GQA for right-padded
    self-attention up to GQA_MAX_KEYS keys; otherwise MHA's key_padding_mask below
    LOOP_MIN_KEYS keys and the Loop form from there."""
    form = forms.key_padding
    gqa_able = info.self_attention and gqa_shapes_ok(info)
    if form == "auto":
        general = either(f"T < {forms.LOOP_MIN_KEYS}", "MHA key_padding_mask",
                         "Loop(Compress keys)", switch_at=(forms.LOOP_MIN_KEYS,))
        if gqa_able and forms.padded_rows_on_gqa(half_precision(info)):
            out = key_padding_gqa(op, info, q3, lambda ops: _by_length(ops, info, q3, forms),
                                  forms.GQA_MAX_KEYS)
            return Lowered(out, either(f"right padding, T <= {forms.GQA_MAX_KEYS}",
                                       "GroupQueryAttention (bidirectional)", general,
                                       switch_at=(forms.GQA_MAX_KEYS + 1,)))
        return Lowered(_by_length(op, info, q3, forms), general)
    if form == "gqa" and gqa_able:
        out = key_padding_gqa(op, info, q3, lambda ops: _padding_form(ops, info, q3, "loop"))
        return Lowered(out, either("right padding", "GroupQueryAttention (bidirectional)",
                                   "Loop(Compress keys)"))
    form = "loop" if form == "gqa" else form
    labels = {"loop": "Loop(Compress keys) + MultiHeadAttention",
              "mask": "MultiHeadAttention + key_padding_mask",
              "bias": "MultiHeadAttention + key padding bias"}
    return Lowered(_padding_form(op, info, q3, form), Form(labels[form]))


def _by_length(op, info: SdpaInfo, q3: ir.Value, forms: FormPolicy) -> ir.Value:
    """If(T < LOOP_MIN_KEYS): MHA with key_padding_mask, else the Loop form."""
    from mha_onnx.rewrite.lower.gqa import if_forms

    keys = op.Reshape(seq_dim(op, info.key, 2), scalar_shape(op))
    cond = op.Less(keys, op.Constant(value=ir.tensor(np.array(forms.LOOP_MIN_KEYS, np.int64))))
    return if_forms(op, info, cond, lambda ops: _padding_form(ops, info, q3, "mask"),
                    lambda ops: _padding_form(ops, info, q3, "loop"), "by_length")


def _padding_form(op, info: SdpaInfo, q3: ir.Value, form: str) -> ir.Value:
    """One key padding form: loop | mask (MHA key_padding_mask) | bias (dense)."""
    k, v, k3d = kv_operands(op, info)
    if form == "loop":
        return padding_loop(op, info, q3, k, v, k3d)
    assert info.padded is not None
    if form == "mask":
        keep = op.Cast(op.Not(info.padded), to=ir.DataType.INT32)
        out = op.MultiHeadAttention(q3, k, v, None, keep, num_heads=info.heads,
                                    scale=info.scale, _domain=MS_DOMAIN)
    else:
        padded = op.Unsqueeze(info.padded, op.Constant(value_ints=[1, 2]))
        fill = float(np.finfo(info.np_dtype).min) if info.fill == -math.inf else info.fill
        bias = op.Where(padded, info.const(op, fill), info.const(op, 0.0))
        full = op.Concat(op.Constant(value_ints=[1, 1]), seq_dim(op, q3, 1),
                         op.Constant(value_ints=[1]), axis=0)
        out = _mha(op, q3, k, v, info, op.Expand(bias, full))
    return fix_all_padded(op, info, out, v, k3d)


# In order, the first that takes a block lowers it (a new kernel form: a row here, its
# predicate saying which blocks, and its choices in policy.py when users pick it).
LOWERINGS = (
    # causal blocks GQA takes, where the policy puts them on it (sinks and soft-capping:
    # GQA's alone, on every execution provider)
    Lowering("GroupQueryAttention", _on_gqa, _gqa),
    # a KV cache appended to, causal aligned to the keys' end (lower/cached.py)
    Lowering("cached: MultiHeadAttention past/present", takes_presents, _cached),
    # sinks on a block GQA does not take (bidirectional: no other kernel takes them)
    Lowering("MultiHeadAttention + sinks", lambda info, _: info.sink is not None, _sinks),
    Lowering("MultiHeadAttention", lambda info, _: info.mask_kind == "none", _plain),
    Lowering("MultiHeadAttention causal", _plain_causal, _causal_mha),
    Lowering("key padding", lambda info, _: info.mask_kind == "key_padding", _key_padding),
    # any other mask: the original's mask as an additive attention_bias
    Lowering("MultiHeadAttention + attention_bias", lambda info, _: True, _dense),
)
