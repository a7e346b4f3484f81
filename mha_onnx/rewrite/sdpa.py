"""The internal ``mha_onnx.fusion.Sdpa`` op between the two stages: how stage 1 writes it
(:func:`emit_sdpa`), how stage 2 reads it (:class:`SdpaInfo`), and the layout helpers both
lowerings share.

``Sdpa(Q [B, H, S, Dk], K [B, G, T, Dk], V [B, G, T, Dv], padded?, bias?, dense?)``:
``padded`` bool [B, T] (True = padded key), ``bias`` the position biases (rank 4, added as
they are), ``dense`` every mask term summed into one additive bias (rank 4): the general form
that is always exact. Stage 2 uses what its form needs; the rest is removed as unused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import dims, ints_attr, producer, same_dim

FUSION_DOMAIN = "mha_onnx.fusion"


@dataclass(frozen=True)
class SdpaInfo:
    """The attributes and operands of one Sdpa node."""

    query: ir.Value  # [B, H, S, Dk]
    key: ir.Value  # [B, G, T, Dk]
    value: ir.Value  # [B, G, T, Dv]
    padded: ir.Value | None  # bool [B, T], True = padded key
    bias: ir.Value | None  # position biases, rank 4
    dense: ir.Value | None  # every mask term as one additive bias, rank 4
    scale: float
    heads: int
    kv_heads: int
    softcap: float
    mask_kind: str
    causal: bool
    window: int
    alignment: str
    fill: float
    fill_mode: str
    nan_to_zero: bool
    self_attention: bool
    block: str
    sink: ir.Value | None = None  # [H] logits in each row's denominator (rewrite/recognise/attention_sinks.py)
    mask_terms: int = 1  # the mask terms ``dense`` sums (more: a key's fills may add up)

    @property
    def dk(self) -> int:
        return int(dims(self.query)[3])  # type: ignore[index]

    @property
    def dv(self) -> int:
        return int(dims(self.value)[3])  # type: ignore[index]

    @property
    def np_dtype(self) -> type:
        return np.float16 if self.query.dtype == ir.DataType.FLOAT16 else np.float32

    def const(self, op, value: float) -> ir.Value:
        """A scalar constant in the attention's dtype."""
        return op.Constant(value=ir.tensor(np.array(value, self.np_dtype)))

    @classmethod
    def of(cls, node: ir.Node) -> SdpaInfo:
        a = {k: v.value for k, v in node.attributes.items()}
        inputs = list(node.inputs) + [None] * (7 - len(node.inputs))
        return cls(
            query=inputs[0], key=inputs[1], value=inputs[2], padded=inputs[3], bias=inputs[4],
            dense=inputs[5], scale=float(a["scale"]), heads=int(a["num_heads"]),
            kv_heads=int(a["kv_heads"]), softcap=float(a["softcap"]),
            mask_kind=str(a["mask_kind"]), causal=bool(a["causal"]), window=int(a["window"]),
            alignment=str(a["alignment"]), fill=float(a["fill"]), fill_mode=str(a["fill_mode"]),
            nan_to_zero=bool(a["nan_to_zero"]), self_attention=bool(a["self_attention"]),
            block=str(a["block"]), sink=inputs[6], mask_terms=int(a.get("mask_terms", 1)),
        )

    def all_masked_value(self) -> str | None:
        """What the original computes for a query whose keys are all masked, when a fused
        form's kernel may compute something else there: "nan", "zero" (a NaN guard), "mean"
        (one equal score everywhere: uniform weights) or None (softmax(s + fill), which any
        additive form reproduces)."""
        from mha_onnx.rewrite.recognise.masks import ABSORBING

        if self.fill == -math.inf:
            return "zero" if self.nan_to_zero else "nan"
        if self.fill_mode == "replace" or self.fill <= ABSORBING:
            return "mean"
        return None


# -- stage 1: writing an Sdpa node ------------------------------------------------------------

def emit_sdpa(op, core) -> ir.Value:
    """Build the Sdpa node for a :class:`~mha_onnx.rewrite.recognise.core.Core`; returns its
    [B, H, S, Dv] (rank 3: [N, S, Dv]) output."""
    query, key, value = core.query, core.key, core.value
    if core.out_dtype is not None:  # float16 values under float32 scores: all in float32
        value = op.Cast(value, to=query.dtype)
        value.shape, value.dtype = core.value.shape, query.dtype
    if core.head_scale is not None:  # c_h (q·k) as (c_h q)·k: Q scaled per head
        np_dtype = np.float16 if query.dtype == ir.DataType.FLOAT16 else np.float32
        factors = core.head_scale.reshape(1, -1, 1, 1).astype(np_dtype)
        query = op.Mul(query, op.Constant(value=ir.tensor(factors)))
        query.shape, query.dtype = core.query.shape, core.query.dtype
    if core.key_form == "bthd":
        key = op.Transpose(key, perm=[0, 2, 1, 3])
    elif core.key_form == "kt":
        key = op.Transpose(key, perm=[0, 1, 3, 2] if core.rank == 4 else [0, 2, 1])
    if core.split_heads:  # [B*H, S, D] -> [B, H, S, D]
        query, key, value = (split_heads(op, x, core.heads) for x in (query, key, value))
    elif core.rank == 3:  # one head per (batch x head) row: [N, 1, S, D]
        axis = op.Constant(value_ints=[1])
        query, key, value = (op.Unsqueeze(x, axis) for x in (query, key, value))
    mask = core.mask
    padded = _padded_keys(op, mask.padding) if mask.padding is not None else None
    bias = _sum_terms(op, core, [_bias_term(b) for b in mask.added]) if mask.added else None
    dense = _sum_terms(op, core, list(mask.terms)) if mask.terms else None
    causal = mask.causal
    attrs = {
        "scale": float(core.scale), "num_heads": core.heads, "kv_heads": core.kv_heads,
        "softcap": float(core.softcap), "mask_kind": mask.kind, "causal": int(causal is not None),
        "window": causal.window if causal else 0, "alignment": causal.alignment if causal else "",
        "fill": float(mask.fill), "fill_mode": mask.mode, "nan_to_zero": int(core.nan_to_zero),
        "self_attention": int(core.self_attention), "block": core.block,
        "mask_terms": len(mask.terms),
    }
    sink = None
    if core.sink is not None:  # in the kernel's dtype: the query's
        np_dtype = np.float16 if query.dtype == ir.DataType.FLOAT16 else np.float32
        sink = op.Constant(value=ir.tensor(core.sink.astype(np_dtype)))
    inputs = [query, key, value, padded, bias, dense, sink]
    while inputs[-1] is None:
        inputs.pop()
    out = op.Sdpa(*inputs, _domain=FUSION_DOMAIN, **attrs)
    if core.split_heads:  # back to [B*H, S, Dv]
        out = op.Reshape(out, op.Concat(op.Constant(value_ints=[-1]),
                                        op.Shape(out, start=2, end=4), axis=0))
    elif core.rank == 3:
        out = op.Squeeze(out, op.Constant(value_ints=[1]))
    return out if core.out_dtype is None else op.Cast(out, to=core.out_dtype)


def split_heads(op, x3: ir.Value, heads: int) -> ir.Value:
    """[B*H, a, b] -> [B, H, a, b]; a tensor broadcast over B*H ([1, a, b]) -> [1, 1, a, b]."""
    shape = dims(x3)
    if shape is not None and shape and shape[0] == 1:
        return op.Unsqueeze(x3, op.Constant(value_ints=[0]))
    out = op.Reshape(x3, op.Concat(op.Constant(value_ints=[-1, heads]),
                                   op.Shape(x3, start=1), axis=0))
    if shape is not None and len(shape) == 3:  # the head size is what the kernels check
        out.shape, out.dtype = ir.Shape([None, heads, shape[1], shape[2]]), x3.dtype
    return out


def _padded_keys(op, padding) -> ir.Value:
    """bool [B, T], True where the key is padded."""
    source = padding.source
    if len(source.shape or ()) > 2:  # [B, 1, T] / [B, 1, 1, T]
        source = op.Reshape(source, op.Constant(value_ints=[0, -1]))
    if source.dtype == ir.DataType.BOOL:
        return op.Not(source) if padding.inverted else source
    is_zero = op.Equal(source, op.CastLike(op.Constant(value_float=0.0), source))
    return is_zero if padding.inverted else op.Not(is_zero)


def _bias_term(leaf):
    from mha_onnx.rewrite.recognise.masks import Term

    return Term("add", leaf.value, leaf.post, lift=leaf.lift)


def _sum_terms(op, core, terms: list) -> ir.Value:
    """The terms as one additive bias of rank 4, in the query's dtype."""
    dtype = core.query.dtype
    np_dtype = np.float16 if dtype == ir.DataType.FLOAT16 else np.float32
    total = None
    for term in terms:
        value = split_heads(op, term.value, term.lift) if term.lift else term.value
        if term.mode == "add":
            piece = value if value.dtype == dtype else op.Cast(value, to=dtype)
            if term.post != 1.0:
                piece = op.Mul(piece, op.Constant(value=ir.tensor(np.array(term.post, np_dtype))))
        else:
            fill, zero = np.array(term.fill * term.post, np_dtype), np.array(0.0, np_dtype)
            on, off = (fill, zero) if term.masked_when else (zero, fill)
            cond = value
            if cond.dtype != ir.DataType.BOOL:
                cond = op.Cast(cond, to=ir.DataType.BOOL)
            piece = op.Where(cond, op.Constant(value=ir.tensor(on)),
                             op.Constant(value=ir.tensor(off)))
        total = piece if total is None else op.Add(total, piece)
    assert total is not None
    # the sum broadcasts to the largest rank among the terms (lifted pieces are 4-D)
    r = max(4 if t.lift else len(dims(t.value) or [None] * core.rank) for t in terms)
    if core.rank == 3 and not core.split_heads:
        if r < 3:
            total = op.Unsqueeze(total, op.Constant(value_ints=list(range(3 - r))))
        return op.Unsqueeze(total, op.Constant(value_ints=[1]))
    if r < 4:
        total = op.Unsqueeze(total, op.Constant(value_ints=list(range(4 - r))))
    return total


# -- layouts ----------------------------------------------------------------------------------

def bsd_source(x4: ir.Value, heads: int) -> ir.Value | None:
    """The [B, S, H*D] tensor that ``x4`` [B, H, S, D] was split from by Reshape+Transpose
    (Reshapes that only take it to another shape and back, as DeBERTa's [B*H, S, D] for
    bmm, looked through)."""
    transpose = producer(_before_reshapes(x4), "Transpose")
    if transpose is None or ints_attr(transpose, "perm") != [0, 2, 1, 3]:
        return None
    reshape = producer(transpose.inputs[0], "Reshape")
    if reshape is None:
        return None
    x3 = reshape.inputs[0]
    d3, d4 = dims(x3), dims(reshape.outputs[0])
    if d3 is None or d4 is None or len(d3) != 3 or len(d4) != 4:
        return None
    if not (isinstance(d4[2], int) and isinstance(d4[3], int) and d4[2] == heads):
        return None
    if not (same_dim(d3[0], d4[0]) and same_dim(d3[1], d4[1]) and d3[2] == d4[2] * d4[3]):
        return None
    return x3


def _before_reshapes(x: ir.Value) -> ir.Value:
    """The earliest value of the chain of Reshapes ending in ``x`` with ``x``'s own dims:
    the same tensor (a Reshape keeps the elements' order). One dim of ``x`` may be unknown
    (split_heads leaves the batch so): the others equal, the element count fixes it."""
    want, found, current = dims(x), x, x
    for _ in range(4):
        node = producer(current, "Reshape")
        if node is None or want is None:
            break
        current = node.inputs[0]
        have = dims(current)
        if have is None or len(have) != len(want):
            continue
        differ = [b for a, b in zip(have, want, strict=True) if not same_dim(a, b)]
        if not differ or (len(differ) == 1 and differ[0] is None and have.count(None) == 0):
            found = current
    return found


def to_bsd(op, x4: ir.Value, heads: int) -> ir.Value:
    """[B, H, S, D] -> [B, S, H*D]: the original 3-D tensor when there is one, else a copy."""
    source = bsd_source(x4, heads)
    if source is not None:
        return source
    moved = op.Transpose(x4, perm=[0, 2, 1, 3])
    out = op.Reshape(moved, op.Constant(value_ints=[0, 0, -1]))
    known = dims(x4)
    if known is not None and len(known) == 4:  # (what seq_dim reads through, to a guard
        b, h, s, d = known                      # shared by every layer: tidy.share_guards)
        moved.shape = ir.Shape([b, s, h, d])
        out.shape = ir.Shape([b, s, h * d if isinstance(h, int) and isinstance(d, int)
                              else None])
        moved.dtype = out.dtype = x4.dtype  # (a shape without a type is not serialized)
    return out


def from_bsd(op, x3: ir.Value, heads: int) -> ir.Value:
    """[B, S, H*D] -> [B, H, S, D]."""
    split = op.Reshape(x3, op.Constant(value_ints=[0, 0, heads, -1]))
    return op.Transpose(split, perm=[0, 2, 1, 3])


def repeat_heads(op, x4: ir.Value, rep: int) -> ir.Value:
    """[B, G, T, D] -> [B, G*rep, T, D], each K/V head serving ``rep`` consecutive heads."""
    if rep == 1:
        return x4
    wide = op.Unsqueeze(x4, op.Constant(value_ints=[2]))  # [B, G, 1, T, D]
    merged = op.Expand(wide, op.Constant(value_ints=[1, 1, rep, 1, 1]))  # [B, G, rep, T, D]
    shape = op.Concat(seq_dim(op, x4, 0), op.Constant(value_ints=[-1]),
                      op.Shape(x4, start=2, end=4), axis=0)
    return op.Reshape(merged, shape)


def seq_dim(op, x: ir.Value, axis: int) -> ir.Value:
    """Shape(x)[axis] as a 1-element int64 tensor, read from the tensor that ``x`` was laid
    out from where that dim is the same (through Transpose, and Reshape of leading dims), so
    that a form taking a length does not keep a layout copy (K's [B, H, T, D] transpose) alive
    on a path that does not use it."""
    x, axis = _dim_origin(x, axis)
    return op.Shape(x, start=axis, end=axis + 1)


def _dim_origin(x: ir.Value, axis: int) -> tuple[ir.Value, int]:
    for _ in range(4):
        node = x.producer()
        if node is None or node.domain not in ("", "ai.onnx") or not node.inputs:
            break
        source = node.inputs[0]
        if node.op_type == "Transpose":
            perm = ints_attr(node, "perm")
            if perm is None or axis >= len(perm) or source is None:
                break
            x, axis = source, perm[axis]
        elif node.op_type == "Reshape" and source is not None:
            before, after = dims(source), dims(x)
            if before is None or after is None or axis >= len(before) - 1 \
                    or any(not same_dim(before[a], after[a]) for a in range(axis + 1)):
                break
            x = source
        else:
            break
    return x, axis
