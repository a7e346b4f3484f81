"""Stage 2 for ``--target ort``: each Sdpa becomes the ONNX Runtime contrib kernel that runs
it fastest, in a form that keeps ORT's fast path (measured, see docs/fusion-forms.md):

- no mask: MultiHeadAttention on [B, S, H*D] inputs (ORT's CPU flash path);
- causal self-attention: GroupQueryAttention (kv_num_heads = num_heads), whose causal kernel
  runs in linear memory where MultiHeadAttention's unidirectional path does not;
- key padding: a Loop over the batch that drops the padded keys (Compress) and runs the
  unmasked MultiHeadAttention; a batch entry with every key padded gets exactly what the
  original graph gave there (NaN, zeros, the mean of V, or the plain softmax);
- any other mask: MultiHeadAttention with an additive attention_bias [B|1, H|1, S, T].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from mha_onnx.errors import ConfigError
from mha_onnx.rewrite.core import FUSION_DOMAIN, BlockLog
from mha_onnx.rewrite.irutil import dims, same_dim
from mha_onnx.rewrite.sdpa import SdpaInfo, bsd_source, from_bsd, seq_dim, to_bsd

MS = "com.microsoft"


@dataclass(frozen=True)
class Forms:
    """Which kernel form each mask kind is lowered to (defaults: fastest measured on CPU,
    docs/fusion-forms.md). causal: gqa | unidirectional | bias; key_padding: loop | mask | bias."""

    causal: str = "gqa"
    key_padding: str = "loop"

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"causal": ("gqa", "unidirectional", "bias"), "key_padding": ("loop", "mask", "bias")}

    def __post_init__(self) -> None:
        for kind, choices in self.CHOICES.items():
            if getattr(self, kind) not in choices:
                raise ConfigError(f"unknown {kind} form {getattr(self, kind)!r}",
                                  hint=f"{kind} forms: {', '.join(choices)}")

    @classmethod
    def parse(cls, items: Sequence[str]) -> Forms:
        """``["causal=bias", "key_padding=mask"]`` -> Forms."""
        values = {}
        for item in items:
            kind, _, form = item.partition("=")
            kind = kind.strip().replace("-", "_")
            if kind not in cls.CHOICES or not form:
                raise ConfigError(f"malformed --form {item!r}",
                                  hint="use causal=gqa|unidirectional|bias or "
                                       "key_padding=loop|mask|bias")
            values[kind] = form.strip()
        return cls(**values)


def _kv_operands(op, info: SdpaInfo) -> tuple[ir.Value, ir.Value, bool]:
    """K and V for MultiHeadAttention: their [B, T, H*D] sources if both have one, else the
    [B, H, T, D] tensors themselves (MHA takes that layout too). Third item: is 3-D."""
    k3, v3 = bsd_source(info.key, info.heads), bsd_source(info.value, info.heads)
    if k3 is not None and v3 is not None:
        return k3, v3, True
    return info.key, info.value, False


def _mha(op, q3, k, v, info: SdpaInfo, bias: ir.Value | None = None) -> ir.Value:
    inputs = [q3, k, v] + ([None, None, bias] if bias is not None else [])
    return op.MultiHeadAttention(*inputs, num_heads=info.heads, scale=info.scale, _domain=MS)


def _gqa_ok(info: SdpaInfo) -> bool:
    return info.self_attention and info.dk == info.dv and info.dk % 8 == 0


def _causal_bias(op, info: SdpaInfo, q3: ir.Value, k: ir.Value, k_is_3d: bool) -> ir.Value:
    """[1, 1, S, T]: 0 where key j <= query i, the fill elsewhere (top-left aligned)."""
    seq_q = seq_dim(op, q3, 1)
    seq_kv = seq_dim(op, k, 1 if k_is_3d else 2)
    ones = op.Expand(op.Constant(value=ir.tensor(np.array(True))), op.Concat(seq_q, seq_kv, axis=0))
    keep = op.Trilu(ones, upper=0)
    fill = info.fill if info.fill != -math.inf else -math.inf
    bias = op.Where(keep, info.const(op, 0.0), info.const(op, fill))
    return op.Unsqueeze(bias, op.Constant(value_ints=[0, 1]))


def lower_ort(op, node: ir.Node, forms: Forms = Forms()) -> tuple[ir.Value, str]:
    """The fused [B, S, H*Dv] output of one Sdpa node and a label of the form used."""
    info = SdpaInfo.of(node)
    q3 = to_bsd(op, info.query, info.heads)
    kind = info.mask_kind
    if kind == "none":
        k, v, _ = _kv_operands(op, info)
        return _mha(op, q3, k, v, info), "MultiHeadAttention"
    if kind == "causal":
        if forms.causal == "gqa" and _gqa_ok(info):
            k3, v3 = to_bsd(op, info.key, info.heads), to_bsd(op, info.value, info.heads)
            total = op.Cast(op.Reshape(seq_dim(op, k3, 1), SCALAR_SHAPE(op)), to=ir.DataType.INT32)
            lens = op.Expand(op.Sub(total, op.Constant(value=ir.tensor(np.array(1, np.int32)))),
                             seq_dim(op, q3, 0))
            out = op.GroupQueryAttention(
                q3, k3, v3, None, None, lens, total, num_heads=info.heads,
                kv_num_heads=info.heads, scale=info.scale, _domain=MS, _outputs=3,
            )[0]
            return out, "GroupQueryAttention (causal)"
        k, v, k3d = _kv_operands(op, info)
        if forms.causal == "unidirectional" and info.self_attention:  # S == T: no alignment issue
            out = op.MultiHeadAttention(q3, k, v, num_heads=info.heads, scale=info.scale,
                                        unidirectional=1, _domain=MS)
            return out, "MultiHeadAttention (unidirectional)"
        bias = _causal_bias(op, info, q3, k, k3d)
        return _mha(op, q3, k, v, info, bias), "MultiHeadAttention + causal bias"
    if kind == "key_padding":
        if forms.key_padding == "loop":
            return _padding_loop(op, info, q3), "Loop(Compress keys) + MultiHeadAttention"
        k, v, k3d = _kv_operands(op, info)
        assert info.mask is not None
        if forms.key_padding == "mask":
            keep = op.Cast(op.Not(info.mask), to=ir.DataType.INT32)
            out = op.MultiHeadAttention(q3, k, v, None, keep, num_heads=info.heads,
                                        scale=info.scale, _domain=MS)
            label = "MultiHeadAttention + key_padding_mask"
        else:
            padded = op.Unsqueeze(info.mask, op.Constant(value_ints=[1, 2]))
            fill = float(np.finfo(info.np_dtype).min) if info.fill == -math.inf else info.fill
            bias = op.Where(padded, info.const(op, fill), info.const(op, 0.0))
            full = op.Concat(op.Constant(value_ints=[1, 1]), seq_dim(op, q3, 1),
                             op.Constant(value_ints=[1]), axis=0)
            out = _mha(op, q3, k, v, info, op.Expand(bias, full))
            label = "MultiHeadAttention + key padding bias"
        return _fix_all_padded(op, info, out, v, k3d), label
    assert kind == "bias", kind
    k, v, _ = _kv_operands(op, info)
    assert info.mask is not None
    full = op.Concat(
        op.Constant(value_ints=[1, 1]), seq_dim(op, q3, 1), op.Constant(value_ints=[1]), axis=0
    )
    bias = op.Expand(info.mask, full)
    out = _mha(op, q3, k, v, info, bias)
    if info.nan_to_zero:
        out = op.Where(op.IsNaN(out), info.const(op, 0.0), out)
    return out, "MultiHeadAttention + attention_bias"


def _fix_all_padded(op, info: SdpaInfo, out3: ir.Value, v: ir.Value, v_is_3d: bool) -> ir.Value:
    """Rows of batch entries whose keys are all padded, set to what the original computes."""
    want = info.all_masked_value()
    if want is None:
        return out3
    if want in ("nan", "zero"):
        special = info.const(op, math.nan if want == "nan" else 0.0)
    elif v_is_3d:
        special = op.Div(op.ReduceSum(v, op.Constant(value_ints=[1]), keepdims=1),
                         op.CastLike(seq_dim(op, v, 1), v))  # [B, 1, H*Dv]
    else:
        mean = op.Div(op.ReduceSum(v, op.Constant(value_ints=[2]), keepdims=1),
                      op.CastLike(seq_dim(op, v, 2), v))  # [B, H, 1, Dv]
        special = op.Reshape(op.Transpose(mean, perm=[0, 2, 1, 3]),
                             op.Constant(value_ints=[0, 1, -1]))
    assert info.mask is not None
    all_padded = op.ReduceMin(op.Cast(info.mask, to=ir.DataType.INT32),
                              op.Constant(value_ints=[1]), keepdims=1)
    all_padded = op.Cast(op.Unsqueeze(all_padded, op.Constant(value_ints=[2])),
                         to=ir.DataType.BOOL)  # [B, 1, 1]
    return op.Where(all_padded, special, out3)


def _padding_loop(op, info: SdpaInfo, q3: ir.Value) -> ir.Value:
    """for b in batch: MHA(q[b], K[b][keep[b]], V[b][keep[b]]); special rows as the original."""
    k, v, is_3d = _kv_operands(op, info)
    t_axis = 1 if is_3d else 2
    padded = info.mask
    assert padded is not None
    body = ir.tape.Tape()

    def const(array: np.ndarray) -> ir.Value:
        return body.op("Constant", [], attributes={"value": ir.tensor(array)})

    i = ir.val("b", ir.DataType.INT64, ir.Shape([]))
    cond_in = ir.val("cond_in", ir.DataType.BOOL, ir.Shape([]))
    start = body.op("Unsqueeze", [i, const(np.array([0], np.int64))])
    stop = body.op("Add", [start, const(np.array([1], np.int64))])
    axis0 = const(np.array([0], np.int64))
    q_b = body.op("Slice", [q3, start, stop, axis0])
    k_b = body.op("Slice", [k, start, stop, axis0])
    v_b = body.op("Slice", [v, start, stop, axis0])
    pad_b = body.op("Squeeze", [body.op("Slice", [padded, start, stop, axis0]), axis0])
    keep = body.op("Not", [pad_b])
    kept = body.op("ReduceSum", [body.op("Cast", [keep], attributes={"to": ir.DataType.INT64})],
                   attributes={"keepdims": 0})
    any_kept = body.op("Greater", [kept, const(np.array(0, np.int64))])

    then = ir.tape.Tape()
    k_kept = then.op("Compress", [k_b, keep], attributes={"axis": t_axis})
    v_kept = then.op("Compress", [v_b, keep], attributes={"axis": t_axis})
    attn = then.op("MultiHeadAttention", [q_b, k_kept, v_kept], domain=MS,
                   attributes={"num_heads": info.heads, "scale": info.scale})
    then_graph = ir.Graph([], [attn], nodes=then.nodes, name="keys_kept")

    other = ir.tape.Tape()
    other_out = _all_padded(other, info, q_b, k_b, v_b, is_3d, t_axis)
    else_graph = ir.Graph([], [other_out], nodes=other.nodes, name="all_keys_padded")

    out_b = body.op("If", [any_kept], attributes={"then_branch": then_graph,
                                                  "else_branch": else_graph})
    cond_out = body.op("Identity", [cond_in])
    for value in (attn, other_out, out_b):  # subgraph outputs need their type declared
        value.dtype = info.query.dtype
    cond_out.dtype = ir.DataType.BOOL
    body_graph = ir.Graph([i, cond_in], [cond_out, out_b], nodes=body.nodes, name="per_batch")

    _name_values(body_graph, f"{_safe(info.block)}_loop")
    trip = op.Reshape(seq_dim(op, q3, 0), SCALAR_SHAPE(op))
    always = op.Constant(value=ir.tensor(np.array(True)))
    stacked = op.Loop(trip, always, body=body_graph)  # [B, 1, S, H*Dv]
    stacked.dtype = info.query.dtype
    return op.Squeeze(stacked, op.Constant(value_ints=[1]))


def _all_padded(tape, info: SdpaInfo, q_b, k_b, v_b, is_3d: bool, t_axis: int) -> ir.Value:
    """What the original graph computes for a batch entry whose keys are all padded."""
    width = info.heads * info.dv

    def const(array: np.ndarray) -> ir.Value:
        return tape.op("Constant", [], attributes={"value": ir.tensor(array)})

    dtype = info.np_dtype
    rows = tape.op("Shape", [q_b], attributes={"start": 1, "end": 2})
    out_shape = tape.op("Concat", [const(np.array([1], np.int64)), rows,
                                   const(np.array([width], np.int64))], attributes={"axis": 0})
    if info.fill == -math.inf:  # softmax of all -inf is NaN; a NaN guard makes it 0
        fill = 0.0 if info.nan_to_zero else math.nan
        return tape.op("Expand", [const(np.array(fill, dtype)), out_shape])
    if info.fill_mode == "replace":  # every score equals the fill: uniform weights, mean of V
        total = tape.op("ReduceSum", [v_b, const(np.array([t_axis], np.int64))],
                        attributes={"keepdims": 1})
        count = tape.op("CastLike", [tape.op("Shape", [v_b], attributes={"start": t_axis,
                                                                        "end": t_axis + 1}), v_b])
        mean = tape.op("Div", [total, count])  # [1, 1, H*Dv] or [1, H, 1, Dv]
        if not is_3d:
            mean = tape.op("Reshape", [tape.op("Transpose", [mean], attributes={"perm": [0, 2, 1, 3]}),
                                       const(np.array([1, 1, width], np.int64))])
        return tape.op("Expand", [mean, out_shape])
    # additive finite fill: softmax(s + fill) over all keys, as the original computes it
    keys = tape.op("Shape", [k_b], attributes={"start": t_axis, "end": t_axis + 1})
    bias_shape = tape.op("Concat", [const(np.array([1, 1], np.int64)), rows, keys],
                         attributes={"axis": 0})
    bias = tape.op("Expand", [const(np.array(info.fill, dtype)), bias_shape])
    return tape.op("MultiHeadAttention", [q_b, k_b, v_b, None, None, bias], domain=MS,
                   attributes={"num_heads": info.heads, "scale": info.scale})


def SCALAR_SHAPE(op) -> ir.Value:  # noqa: N802 - reads like a constant
    """The shape [] (for Reshape to a scalar)."""
    return op.Constant(value=ir.tensor(np.zeros(0, np.int64)))


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in text) or "block"


def _name_values(graph: ir.Graph, prefix: str) -> None:
    """Unique names for every value of a subgraph (and its own subgraphs): ONNX needs graph
    names to be SSA across nesting levels, which the tape leaves to us."""
    counter = 0
    for sub in _graphs(graph):
        for value in sub.inputs:
            value.name = f"{prefix}_{counter}"
            counter += 1
        for node in sub:
            node.name = f"{prefix}_{node.op_type}_{counter}"
            for out in node.outputs:
                out.name = f"{prefix}_{counter}"
                counter += 1


def _graphs(graph: ir.Graph):
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graphs(attr.value)


class LowerMergedOutput(pattern.RewriteRuleClassBase):
    """Reshape(Transpose(Sdpa, [0,2,1,3]), [B, S, H*Dv]) -> the kernel's 3-D output directly."""

    def __init__(self, log: BlockLog, forms: dict[str, str], policy: Forms) -> None:
        super().__init__("LowerMergedOutput")
        self.log, self.forms, self.policy = log, forms, policy

    def pattern(self, op, q, k, v, shape):
        sdpa = op.Sdpa(q, k, v, _domain=FUSION_DOMAIN, _allow_other_inputs=True,
                       _allow_other_attributes=True, _outputs=["sdpa"])
        merged = op.Transpose(sdpa, perm=[0, 2, 1, 3])
        return op.Reshape(merged, shape, _allow_other_attributes=True, _outputs=["merged"])

    def check(self, context, sdpa, merged, **_):
        result = MatchResult()
        info = SdpaInfo.of(sdpa.producer())
        out, src = dims(merged), dims(sdpa)
        if out is None or src is None or len(out) != 3 or len(src) != 4:
            return result.fail("merged output shape unknown")
        if not (same_dim(out[0], src[0]) and same_dim(out[1], src[2])
                and out[2] == info.heads * info.dv):
            return result.fail("reshape does not merge heads into [B, S, H*Dv]")
        return result

    def rewrite(self, op, sdpa, merged, **_):
        out, form = lower_ort(op, sdpa.producer(), self.policy)
        self.forms[SdpaInfo.of(sdpa.producer()).block] = form
        return out


class LowerSdpa(pattern.RewriteRuleClassBase):
    """Sdpa -> kernel, then back to [B, H, S, Dv] for whatever consumes it."""

    def __init__(self, log: BlockLog, forms: dict[str, str], policy: Forms) -> None:
        super().__init__("LowerSdpa")
        self.log, self.forms, self.policy = log, forms, policy

    def pattern(self, op, q, k, v):
        return op.Sdpa(q, k, v, _domain=FUSION_DOMAIN, _allow_other_inputs=True,
                       _allow_other_attributes=True, _outputs=["sdpa"])

    def rewrite(self, op, sdpa, **_):
        node = sdpa.producer()
        info = SdpaInfo.of(node)
        out, form = lower_ort(op, node, self.policy)
        self.forms[info.block] = form
        return from_bsd(op, out, info.heads)
