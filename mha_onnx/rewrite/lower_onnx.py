"""Stage 2 for ``--target onnx``: each Sdpa becomes the standard ONNX ``Attention`` op
(opset 23), in a form ONNX Runtime accepts: masks broadcast to [B, 1, S, T] (ORT refuses
[B, 1, 1, T]), and fully masked rows set explicitly to what the original graph gives there
(ORT's Attention returns zeros for them; the spec's reference gives NaN)."""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_onnx.rewrite.core import FUSION_DOMAIN
from mha_onnx.rewrite.masks import ABSORBING
from mha_onnx.rewrite.sdpa import SdpaInfo, seq_dim

ONNX_ATTENTION_OPSET = 23


def _full_rows(op, x: ir.Value, q: ir.Value) -> ir.Value:
    """Expand a [B|1, H|1, 1|S, T] mask over the query axis to [.., S, T]."""
    target = op.Concat(op.Constant(value_ints=[1, 1]), seq_dim(op, q, 2),
                       op.Constant(value_ints=[1]), axis=0)
    return op.Expand(x, target)


def _mean_v(op, value: ir.Value) -> ir.Value:
    """[B, H, 1, Dv]: the mean of V over the keys (uniform attention weights)."""
    total = op.ReduceSum(value, op.Constant(value_ints=[2]), keepdims=1)
    return op.Div(total, op.CastLike(seq_dim(op, value, 2), value))


def _nan_or_zero(op, info: SdpaInfo) -> ir.Value:
    """Softmax over all -inf is NaN; a NaN guard after the softmax makes it 0."""
    return info.const(op, 0.0 if info.nan_to_zero else math.nan)


def lower_onnx(op, node: ir.Node) -> tuple[ir.Value, str]:
    """The fused [B, H, S, Dv] output of one Sdpa node and a label of the form used.

    ORT's Attention gives 0 for a query whose keys are all masked (-inf or the lowest float);
    the original graph gives NaN (-inf), 0 (NaN guard) or the mean of V (one equal finite
    fill on every key), so those rows are set explicitly.
    """
    info = SdpaInfo.of(node)
    q, k, v = info.query, info.key, info.value
    kind = info.mask_kind
    if kind == "none":
        return op.Attention(q, k, v, scale=info.scale), "Attention"
    if kind == "causal":  # top-left aligned: no row is ever fully masked
        return op.Attention(q, k, v, scale=info.scale, is_causal=1), "Attention (is_causal)"
    assert info.mask is not None
    if kind == "key_padding":
        padded_b11t = op.Unsqueeze(info.mask, op.Constant(value_ints=[1, 2]))
        if info.fill == -math.inf:
            mask = _full_rows(op, op.Not(padded_b11t), q)  # bool, True = attend
            special = _nan_or_zero(op, info)
        else:
            fill = op.Where(padded_b11t, info.const(op, info.fill), info.const(op, 0.0))
            mask = _full_rows(op, fill, q)
            uniform = info.fill_mode == "replace" or info.fill <= ABSORBING
            special = _mean_v(op, v) if uniform else None
        out = op.Attention(q, k, v, mask, scale=info.scale)
        if special is not None:
            all_padded = op.ReduceMin(op.Cast(info.mask, to=ir.DataType.INT32),
                                      op.Constant(value_ints=[1]), keepdims=1)
            all_padded = op.Cast(op.Reshape(all_padded, op.Constant(value_ints=[-1, 1, 1, 1])),
                                 to=ir.DataType.BOOL)
            out = op.Where(all_padded, special, out)
        return out, "Attention + key mask [B,1,S,T]"
    bias = _full_rows(op, info.mask, q)
    out = op.Attention(q, k, v, bias, scale=info.scale)
    row_max = op.ReduceMax(bias, op.Constant(value_ints=[-1]), keepdims=1)
    neg_inf = op.Equal(row_max, info.const(op, -math.inf))
    special = op.Where(neg_inf, _nan_or_zero(op, info), _mean_v(op, v))
    absorbed = op.LessOrEqual(row_max, info.const(op, ABSORBING))
    out = op.Where(absorbed, special, out)
    if info.nan_to_zero:
        out = op.Where(op.IsNaN(out), info.const(op, 0.0), out)
    return out, "Attention + attention bias"


class LowerToOnnxAttention(pattern.RewriteRuleClassBase):
    def __init__(self, forms: dict[str, str]) -> None:
        super().__init__("LowerToOnnxAttention")
        self.forms = forms

    def pattern(self, op, q, k, v):
        return op.Sdpa(q, k, v, _domain=FUSION_DOMAIN, _allow_other_inputs=True,
                       _allow_other_attributes=True, _outputs=["sdpa"])

    def rewrite(self, op, sdpa, **_):
        out, form = lower_onnx(op, sdpa.producer())
        self.forms[SdpaInfo.of(sdpa.producer()).block] = form
        return out


