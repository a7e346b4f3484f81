"""Stage 2 for ``--target onnx``: each Sdpa becomes the standard ONNX ``Attention`` op
(opset 23), in a form ONNX Runtime accepts: masks broadcast to [B, 1, S, T] (ORT refuses
[B, 1, 1, T]), and fully masked rows set explicitly to what the original graph gives there
(ORT's Attention returns zeros for them; the spec's reference gives NaN). Grouped K/V stay
grouped (the op takes fewer K/V heads); causal masks without padding use ``is_causal``."""

from __future__ import annotations

import math
from dataclasses import replace

import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_onnx.rewrite.forms import Form
from mha_onnx.rewrite.lower.common import absorbed_mean, causal_bias, mean_over_keys
from mha_onnx.rewrite.recognise.masks import ABSORBING
from mha_onnx.rewrite.sdpa import FUSION_DOMAIN, SdpaInfo, repeat_heads, seq_dim

ONNX_ATTENTION_OPSET = 23


def _full_rows(op, x: ir.Value, q: ir.Value) -> ir.Value:
    """Expand a [B|1, H|1, 1|S, T] mask over the query axis to [.., S, T]."""
    target = op.Concat(op.Constant(value_ints=[1, 1]), seq_dim(op, q, 2),
                       op.Constant(value_ints=[1]), axis=0)
    return op.Expand(x, target)


def _nan_or_zero(op, info: SdpaInfo) -> ir.Value:
    """Softmax over all -inf is NaN; a NaN guard after the softmax makes it 0."""
    return info.const(op, 0.0 if info.nan_to_zero else math.nan)


def _attention(op, info: SdpaInfo, *extra: ir.Value, **attrs) -> ir.Value:
    if info.softcap:
        attrs["softcap"] = info.softcap
    return op.Attention(info.query, info.key, info.value, *extra, scale=info.scale, **attrs)


def _key_padding(op, info: SdpaInfo) -> ir.Value:
    assert info.padded is not None
    q = info.query
    padded_b11t = op.Unsqueeze(info.padded, op.Constant(value_ints=[1, 2]))
    if info.fill == -math.inf:
        mask = _full_rows(op, op.Not(padded_b11t), q)  # bool, True = attend
        special = _nan_or_zero(op, info)
    else:
        fill = op.Where(padded_b11t, info.const(op, info.fill), info.const(op, 0.0))
        mask = _full_rows(op, fill, q)
        uniform = info.fill_mode == "replace" or info.fill <= ABSORBING
        special = _mean_of_values(op, info) if uniform else None
    out = _attention(op, info, mask)
    if special is None:
        return out
    all_padded = op.ReduceMin(op.Cast(info.padded, to=ir.DataType.INT32),
                              op.Constant(value_ints=[1]), keepdims=1)
    all_padded = op.Cast(op.Reshape(all_padded, op.Constant(value_ints=[-1, 1, 1, 1])),
                         to=ir.DataType.BOOL)
    return op.Where(all_padded, special, out)


def _mean_of_values(op, info: SdpaInfo) -> ir.Value:
    """The mean of V over the keys, [B, H, 1, Dv]: a fully masked row's value where every key
    got one equal finite score. Grouped K/V: the mean of each K/V head, repeated for the
    query heads it serves (as the output has H heads, not G)."""
    mean = mean_over_keys(op, info.value, 2)
    rep = info.heads // info.kv_heads
    return mean if rep == 1 else repeat_heads(op, mean, rep)


def _dense(op, info: SdpaInfo) -> ir.Value:
    q = info.query
    dense = info.dense
    if dense is None:  # is_causal that cannot stay is_causal (never met so far)
        dense = causal_bias(op, info, seq_dim(op, q, 2), seq_dim(op, info.key, 2))
    bias = _full_rows(op, dense, q)
    out = _attention(op, info, bias)
    row_max = op.ReduceMax(bias, op.Constant(value_ints=[-1]), keepdims=1)
    neg_inf = op.Equal(row_max, info.const(op, -math.inf))
    # one term: every key of a fully masked row has the one fill (uniform); more: fills may
    # add up (GPT-Neo: a key both hide is -inf), so the keys at the row's highest mask value
    mean = _mean_of_values(op, info) if info.mask_terms == 1 else \
        absorbed_mean(op, info, dense, info.value)
    special = op.Where(neg_inf, _nan_or_zero(op, info), mean)
    out = op.Where(op.LessOrEqual(row_max, info.const(op, ABSORBING)), special, out)
    if info.nan_to_zero:
        out = op.Where(op.IsNaN(out), info.const(op, 0.0), out)
    return out


def lower_onnx(op, node: ir.Node, ungroup: bool = False) -> tuple[ir.Value, Form]:
    """The fused [B, H, S, Dv] output of one Sdpa node and a label of the form used.

    ORT's Attention gives 0 for a query whose keys are all masked (-inf or the lowest float);
    the original graph gives NaN (-inf), 0 (NaN guard) or the mean of V (one equal finite
    fill on every key), so those rows are set explicitly. ``ungroup``: grouped K/V repeated
    to every query head first (OpenVINO 2026.4's Attention import refuses fewer K/V heads).
    """
    info = SdpaInfo.of(node)
    if ungroup and info.kv_heads != info.heads:
        rep = info.heads // info.kv_heads
        info = replace(info, key=repeat_heads(op, info.key, rep),
                       value=repeat_heads(op, info.value, rep), kv_heads=info.heads)
    kind = info.mask_kind
    if kind == "none":
        return _attention(op, info), Form("Attention")
    plain_causal = (info.causal and info.padded is None and info.bias is None
                    and not info.window and info.alignment in ("square", "top-left"))
    if plain_causal:  # top-left aligned, as the op's is_causal: no row is ever fully masked
        return _attention(op, info, is_causal=1), Form("Attention (is_causal)")
    if kind == "key_padding":
        return _key_padding(op, info), Form("Attention + key mask [B,1,S,T]")
    return _dense(op, info), Form("Attention + attention bias")


class LowerToOnnxAttention(pattern.RewriteRuleClassBase):
    def __init__(self, forms: dict[str, Form], ungroup: bool = False) -> None:
        super().__init__("LowerToOnnxAttention")
        self.forms = forms
        self.ungroup = ungroup

    def pattern(self, op, q, k, v):
        return op.Sdpa(q, k, v, _domain=FUSION_DOMAIN, _allow_other_inputs=True,
                       _allow_other_attributes=True, _outputs=["sdpa"])

    def rewrite(self, op, sdpa, **_):
        out, form = lower_onnx(op, sdpa.producer(), self.ungroup)
        self.forms[SdpaInfo.of(sdpa.producer()).block] = form
        return out
