"""Stage 2 for ``--target ort``: each Sdpa becomes the ONNX Runtime contrib kernel that runs
it fastest, in a form that keeps ORT's fast path (measured, see docs/fusion-forms.md):

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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from mha_onnx.config import EP_CHOICES, FORM_CHOICES, form_help
from mha_onnx.errors import ConfigError
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
from mha_onnx.rewrite.sdpa import (
    SdpaInfo,
    seq_dim,
    to_bsd,
)


@dataclass(frozen=True)
class Forms:
    """Which kernel form each mask kind is lowered to (defaults: fastest measured on CPU,
    docs/fusion-forms.md). causal: gqa | unidirectional | bias; key_padding: auto | loop |
    mask | bias | gqa (auto: gqa up to GQA_MAX_KEYS keys when right-padded, else loop)."""

    causal: str = "gqa"
    key_padding: str = "auto"
    kv_cache: str = "appended"  # or shared: max-length cache buffers (lower/shared.py)
    # The execution provider the forms are for. On CUDA (docs/gpu/2026-11-30-h200.md) GQA is
    # kept only where no other kernel is exact (soft-capping, sliding windows): ORT's CUDA GQA
    # has no float32 kernel (the node runs on the CPU) and its float16 right-padded branch
    # disagreed with the original there; KV-cache layers keep their forms.
    ep: str = "cpu"

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        **FORM_CHOICES, "ep": EP_CHOICES}
    given: tuple[str, ...] = field(default=(), compare=False)  # kinds set by --form
    # Bidirectional GQA holds the [B, H, S, T] probabilities: fastest up to ~1k keys, then
    # slower than the Loop form and O(L^2) in memory (docs/fusion-forms.md, key padding).
    GQA_MAX_KEYS: ClassVar[int] = 1024
    # Below this many keys the Loop's per-row cost shows; MHA's key_padding_mask is as fast
    # as the original there (docs/fusion-forms.md, key padding by shape).
    LOOP_MIN_KEYS: ClassVar[int] = 128

    def __post_init__(self) -> None:
        for kind, choices in self.CHOICES.items():
            if getattr(self, kind) not in choices:
                raise ConfigError(f"unknown {kind} form {getattr(self, kind)!r}",
                                  hint=f"{kind} forms: {', '.join(choices)}")

    @classmethod
    def for_ep(cls, ep: str = "cpu") -> Forms:
        """The forms measured fastest on an execution provider: CPU, docs/fusion-forms.md;
        CUDA (and TensorRT, whose sessions run ORT's contrib ops on CUDA), docs/gpu/: MHA
        unidirectional for causal blocks (0.08-0.62x of the unfused graph in float16, faster
        than GQA at every shape measured) and MHA with the padding as a dense bias (no If:
        the run-time checks cost more than they save on a GPU at short lengths)."""
        if ep == "cpu":
            return cls()
        return cls(causal="unidirectional", key_padding="bias", ep=ep)

    def gqa_for(self, *, softcap: bool = False, window: bool = False) -> bool:
        """Whether causal blocks go onto GroupQueryAttention: the CPU default; elsewhere
        only blocks no other kernel computes exactly in linear memory."""
        return self.causal == "gqa" or (self.ep != "cpu" and (softcap or window))

    @classmethod
    def parse(cls, items: Sequence[str], ep: str = "cpu") -> Forms:
        """``["causal=bias", "key_padding=mask"]`` over the forms of ``ep`` -> Forms."""
        values = {}
        for item in items:
            kind, _, form = item.partition("=")
            kind = kind.strip().replace("-", "_")
            if kind not in FORM_CHOICES or not form:
                raise ConfigError(f"malformed --form {item!r}", hint=f"use {form_help()}")
            values[kind] = form.strip()
        if ep not in cls.CHOICES["ep"]:
            raise ConfigError(f"unknown execution provider {ep!r} for --ep",
                              hint=f"use {' | '.join(cls.CHOICES['ep'])}")
        return replace(cls.for_ep(ep), **values, given=tuple(values))


def _mha(op, q3, k, v, info: SdpaInfo, bias: ir.Value | None = None) -> ir.Value:
    inputs = [q3, k, v] + ([None, None, bias] if bias is not None else [])
    return op.MultiHeadAttention(*inputs, num_heads=info.heads, scale=info.scale,
                                 _domain=MS_DOMAIN)


def lower_ort(op, node: ir.Node, forms: Forms = Forms(), cache: Caches | None = None
              ) -> Lowered:
    """One Sdpa node onto its kernel: the fused [B, S, H*Dv] output and the form used;
    ``cache``: the layer's appended caches, whose presents the rule returns (lowered.py)."""
    info = SdpaInfo.of(node)
    q3 = to_bsd(op, info.query, info.heads)
    if _on_gqa(info, forms):
        return Lowered(*lower_gqa(op, info, q3, right_padded=forms.ep == "cpu"))
    if takes_presents(info, forms):
        return lower_cached(op, info, q3, cache, forms.kv_cache)
    if info.sink is not None:  # (no other MultiHeadAttention form takes them)
        return Lowered(dense_mha(op, info, q3, lazy=False),
                       Form("MultiHeadAttention + attention_bias, sinks as a key of zeros"))
    kind = info.mask_kind
    if kind == "none":
        k, v, _ = kv_operands(op, info)
        return Lowered(_mha(op, q3, k, v, info), Form("MultiHeadAttention"))
    if kind == "causal" and info.padded is None and info.bias is None and not info.window:
        return Lowered(*_causal_mha(op, info, q3, forms))
    if kind == "key_padding":
        return Lowered(*_key_padding(op, info, q3, forms))
    return Lowered(dense_mha(op, info, q3, lazy=False), Form("MultiHeadAttention + attention_bias"))


def _on_gqa(info: SdpaInfo, forms: Forms) -> bool:
    return info.causal and gqa_ok(info) \
        and forms.gqa_for(softcap=bool(info.softcap) or info.sink is not None,
                          window=bool(info.window))


def takes_presents(info: SdpaInfo, forms: Forms) -> bool:
    """Whether the block runs on a kernel with past and present (lower/cached.py), so that
    given its appended caches it returns the presents."""
    return not _on_gqa(info, forms) and (forms.causal == "gqa" or forms.ep != "cpu") \
        and cached_ok(info)


def _causal_mha(op, info: SdpaInfo, q3: ir.Value, forms: Forms) -> tuple[ir.Value, Form]:
    k, v, k3d = kv_operands(op, info)
    if forms.causal == "unidirectional" and info.alignment == "square":
        out = op.MultiHeadAttention(q3, k, v, num_heads=info.heads, scale=info.scale,
                                    unidirectional=1, _domain=MS_DOMAIN)
        return out, Form("MultiHeadAttention (unidirectional)")
    if info.alignment == "bottom-right":
        return dense_mha(op, info, q3, lazy=False), Form("MultiHeadAttention + attention_bias")
    bias = causal_bias(op, info, seq_dim(op, q3, 1), seq_dim(op, k, 1 if k3d else 2))
    return _mha(op, q3, k, v, info, bias), Form("MultiHeadAttention + causal bias")


def _key_padding(op, info: SdpaInfo, q3: ir.Value, forms: Forms) -> tuple[ir.Value, Form]:
    """The key padding form: fixed by ``forms``, or (auto) chosen at run time by shape and
    padding, from measurements (docs/fusion-forms.md): bidirectional GQA for right-padded
    self-attention up to GQA_MAX_KEYS keys; otherwise MHA's key_padding_mask below
    LOOP_MIN_KEYS keys and the Loop form from there."""
    form = forms.key_padding
    gqa_able = info.self_attention and gqa_shapes_ok(info)
    if form == "auto":
        general = either(f"T < {forms.LOOP_MIN_KEYS}", "MHA key_padding_mask",
                         "Loop(Compress keys)", switch_at=(forms.LOOP_MIN_KEYS,))
        if gqa_able and not half_precision(info):
            out = key_padding_gqa(op, info, q3, lambda ops: _by_length(ops, info, q3, forms),
                                  forms.GQA_MAX_KEYS)
            return out, either(f"right padding, T <= {forms.GQA_MAX_KEYS}",
                               "GroupQueryAttention (bidirectional)", general,
                               switch_at=(forms.GQA_MAX_KEYS + 1,))
        return _by_length(op, info, q3, forms), general
    if form == "gqa" and gqa_able:
        out = key_padding_gqa(op, info, q3, lambda ops: _padding_form(ops, info, q3, "loop"))
        return out, either("right padding", "GroupQueryAttention (bidirectional)",
                           "Loop(Compress keys)")
    form = "loop" if form == "gqa" else form
    labels = {"loop": "Loop(Compress keys) + MultiHeadAttention",
              "mask": "MultiHeadAttention + key_padding_mask",
              "bias": "MultiHeadAttention + key padding bias"}
    return _padding_form(op, info, q3, form), Form(labels[form])


def _by_length(op, info: SdpaInfo, q3: ir.Value, forms: Forms) -> ir.Value:
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
