"""What a mask between Q·K^T and the Softmax means.

Attention graphs mask in many spellings: ``Where(pad, -inf, scores)``, ``scores + bias`` with
``bias = Where(keep, 0, -inf)``, Hugging Face's ``(1 - mask) * finfo.min``, ``Trilu`` of ones
for causal masks, each behind Reshape/Unsqueeze/Expand. This module reduces a mask term to one
of three kinds that decide the fused form:

- key padding: a ``[B, T]`` tensor that removes keys (fast: the padded keys are dropped),
- causal: query i sees keys 0..i (top-left aligned),
- anything else: a dense additive bias (always correct, O(S·T) memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import (
    Dim,
    const_array,
    const_fill,
    const_ints,
    const_scalar,
    dims,
    int_attr,
    producer,
    same_dim,
)

LAYOUT_OPS = ("Reshape", "Unsqueeze", "Expand", "Identity", "GatherND")
# A fill at or below this (after scaling) makes exp(fill - max) flush to zero in float32,
# so masked keys are exactly removed (e^-100 ~ 4e-44 is below float32's normal range).
REMOVES_KEY = -100.0
# Below this a float32 score plus the fill rounds to the fill itself.
ABSORBING = -1e30


@dataclass(frozen=True)
class Term:
    """One masking step found walking up from the Softmax.

    mode "add": scores + value; mode "replace": Where(value == masked_when, fill, scores).
    ``post`` is the product of the scale factors applied after this step.
    """

    mode: str
    value: ir.Value
    post: float
    fill: float = 0.0
    masked_when: bool = True


@dataclass(frozen=True)
class BoolMeaning:
    """What a boolean (or 0/1) tensor says about keys: kind "key_padding" (``source`` is
    [B, T], masked where ``source != 0`` unless ``inverted``), "causal", "none" (masks
    nothing), "all" (masks everything) or "other"."""

    kind: str
    source: ir.Value | None = None
    inverted: bool = False


@dataclass(frozen=True)
class MaskPlan:
    """The mask of one attention block, reduced to the kind that picks the fused form."""

    kind: str  # "none" | "causal" | "key_padding" | "bias"
    fill: float = -math.inf  # effective score of a masked key (key_padding/causal)
    mode: str = "add"  # how a key_padding fill was applied (decides fully padded rows)
    padding: BoolMeaning | None = None
    terms: tuple[Term, ...] = ()
    reason: str = ""  # why a mask stayed a dense bias


@dataclass(frozen=True)
class ScoreDims:
    batch: Dim
    heads: Dim
    seq_q: Dim
    seq_kv: Dim
    rank: int


def strip_layout(value: ir.Value) -> tuple[ir.Value, bool]:
    """Follow Reshape/Unsqueeze/rank-keeping Expand/Identity up; (source, layout-only ok)."""
    current = value
    for _ in range(16):
        node = producer(current, *LAYOUT_OPS)
        if node is None:
            return current, True
        if node.op_type == "Expand":
            src = node.inputs[0]
            r_in, r_out = _rank(src), _rank(node.outputs[0])
            if r_in is None or r_in != r_out:
                return current, False
        if node.op_type == "GatherND" and not _is_broadcast_gather(node):
            return current, False
        current = node.inputs[0]
    return current, False


def _arange_axis(value: ir.Value | None) -> int | None:
    """The axis along which ``value`` is ``0, 1, 2, ...`` (Range(0, n, 1) unsqueezed and
    expanded into a larger shape), or None."""
    path = []  # from value up to the Range
    current = value
    for _ in range(8):
        node = producer(current, "Unsqueeze", "Expand", "Cast")
        if node is None:
            break
        path.append(node)
        current = node.inputs[0]
    rng = producer(current, "Range")
    if rng is None or const_scalar(rng.inputs[0]) != 0 or const_scalar(rng.inputs[2]) != 1:
        return None
    axis, rank_now = 0, 1
    for node in reversed(path):  # follow the arange's axis down to ``value``
        if node.op_type == "Unsqueeze":
            axes = const_ints(node.inputs[1])
            if axes is None:
                return None
            rank_now += len(axes)
            for a in sorted(x % rank_now for x in axes):
                if a <= axis:
                    axis += 1
        elif node.op_type == "Expand" and _rank(node.outputs[0]) != rank_now:
            return None
    return axis


def _is_broadcast_gather(node: ir.Node) -> bool:
    """GatherND(data [B, T], indices [..., 2]) whose two index planes are aranges along the
    output's first and last axes: ``data[b, t]`` broadcast (how Hugging Face builds padding
    masks). A layout op then."""
    if int_attr(node, "batch_dims", 0) != 0 or _rank(node.inputs[0]) != 2:
        return False
    concat = producer(node.inputs[1], "Concat")
    out_rank = _rank(node.outputs[0])
    if concat is None or len(concat.inputs) != 2 or out_rank is None:
        return False
    planes = []
    for part in concat.inputs:
        squeeze = producer(part, "Unsqueeze")
        if squeeze is None or const_ints(squeeze.inputs[1]) not in ([-1], [out_rank]):
            return False
        planes.append(_arange_axis(squeeze.inputs[0]))
    return planes == [0, out_rank - 1]


def _always_true(value: ir.Value | None) -> bool:
    """A boolean tensor that is True everywhere: a constant, And of such, or
    ``arange(0, n) >= c`` with c <= 0 (Hugging Face's trivially true mask terms)."""
    if value is None:
        return False
    constant = const_fill(value)
    if constant is not None:
        return constant != 0
    current, layout_ok = strip_layout(value)
    if not layout_ok:
        return False
    node = producer(current)
    if node is None:
        return False
    if node.op_type == "And":
        return all(_always_true(v) for v in node.inputs)
    if node.op_type == "GreaterOrEqual":
        bound = const_scalar(node.inputs[1])
        return bound is not None and bound <= 0 and _arange_axis(node.inputs[0]) is not None
    return False


def _rank(value: ir.Value | None) -> int | None:
    shape = dims(value)
    return None if shape is None else len(shape)


def _is_ones(value: ir.Value | None) -> bool:
    """A tensor of ones: a constant, Expand(1, shape), ConstantOfShape(1)."""
    if value is None:
        return False
    array = const_array(value)
    if array is not None:
        return array.size > 0 and bool(np.all(array == 1))
    node = producer(value, "Expand")
    if node is not None:
        return _is_ones(node.inputs[0])
    node = producer(value, "ConstantOfShape")
    if node is not None:
        attr = node.attributes.get("value")
        return attr is not None and bool(np.all(attr.value.numpy() == 1))
    node = producer(value, "Cast")
    return node is not None and _is_ones(node.inputs[0])


def _outer_fits(value: ir.Value, sd: ScoreDims, key_axis_only: bool) -> bool:
    """Does ``value`` broadcast onto the scores as [B|1, H|1, 1|S, T] (key padding) or
    [1.., S, T] (causal)?"""
    shape = dims(value)
    if shape is None or not shape:
        return False
    if key_axis_only:
        if sd.rank != 4 or len(shape) != 4:
            return False
        return (
            same_dim(shape[0], sd.batch)
            and (shape[1] == 1 or same_dim(shape[1], sd.heads))
            and (shape[2] == 1 or same_dim(shape[2], sd.seq_q))
            and same_dim(shape[3], sd.seq_kv)
        )
    if len(shape) < 2 or len(shape) > sd.rank:
        return False
    lead_ok = all(d == 1 for d in shape[:-2])
    return lead_ok and same_dim(shape[-2], sd.seq_q) and same_dim(shape[-1], sd.seq_kv)


def bool_meaning(value: ir.Value, sd: ScoreDims, outer: ir.Value | None = None) -> BoolMeaning:
    """Classify a boolean tensor whose True entries mark masked positions. ``outer`` is the
    value the scores actually see when ``value`` sits under elementwise/layout ops."""
    inverted = False
    current = value
    outer = value if outer is None else outer
    for _ in range(16):
        current, layout_ok = strip_layout(current)
        if not layout_ok:
            return BoolMeaning("other")
        constant = const_fill(current)
        if constant is not None:  # masks nothing (e.g. an all-True keep mask) or everything
            return BoolMeaning("all" if (constant != 0) != inverted else "none")
        node = producer(current)
        if node is not None and node.op_type == "And":  # True & x == x
            rest = [v for v in node.inputs if not _always_true(v)]
            if len(rest) == 1:
                current = rest[0]
                continue
            if not rest:
                return BoolMeaning("all" if not inverted else "none")
            return BoolMeaning("other")
        if node is not None and node.op_type == "Not":
            inverted = not inverted
            current = node.inputs[0]
            continue
        if node is not None and node.op_type == "Equal":
            a, b = node.inputs
            if const_scalar(b) == 0.0:
                inverted, current = not inverted, a
                continue
            if const_scalar(a) == 0.0:
                inverted, current = not inverted, b
                continue
            return BoolMeaning("other")
        if node is not None and node.op_type == "Cast":
            current = node.inputs[0]  # keeps zero / nonzero apart (0/1 masks)
            continue
        if node is not None and node.op_type == "Trilu":
            return _trilu_meaning(node, outer, sd, inverted)
        break
    shape = dims(current)
    if (
        shape is not None
        and len(shape) == 2
        and same_dim(shape[0], sd.batch)
        and same_dim(shape[1], sd.seq_kv)
        and _outer_fits(outer, sd, key_axis_only=True)
        and (current.dtype is not None and (current.dtype == ir.DataType.BOOL
                                            or current.dtype.is_integer()
                                            or current.dtype.is_floating_point()))
    ):
        return BoolMeaning("key_padding", current, inverted)
    return BoolMeaning("other")


def _trilu_meaning(node: ir.Node, outer: ir.Value, sd: ScoreDims, inverted: bool) -> BoolMeaning:
    """Trilu of ones: lower (upper=0, k=0) keeps j <= i; upper with k=1 marks j > i."""
    if not _is_ones(node.inputs[0]) or not _outer_fits(outer, sd, key_axis_only=False):
        return BoolMeaning("other")
    k = const_scalar(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else 0
    upper = int_attr(node, "upper", 1)
    if upper == 0 and k == 0:  # True = keep -> masked where False
        return BoolMeaning("causal", inverted=not inverted)
    if upper == 1 and k == 1:  # True = masked
        return BoolMeaning("causal", inverted=inverted)
    return BoolMeaning("other")


def bias_meaning(term: Term, sd: ScoreDims) -> tuple[BoolMeaning, float] | None:
    """For an additive bias that is 0 where kept and a fill where masked: (meaning, fill).
    None when the bias is some other float tensor."""
    core, layout_ok = strip_layout(term.value)
    if not layout_ok:
        return None
    node = producer(core)
    if node is None:
        return None
    if node.op_type == "Where":
        cond, a, b = node.inputs
        ca, cb = const_fill(a), const_fill(b)
        if ca is None or cb is None:
            return None
        if cb == 0.0 and ca != 0.0:
            meaning, fill = bool_meaning(cond, sd, term.value), ca
        elif ca == 0.0 and cb != 0.0:
            meaning, fill = _invert(bool_meaning(cond, sd, term.value)), cb
        else:
            return None
        return meaning, fill
    if node.op_type == "Mul":
        # Hugging Face: (1.0 - keep) * finfo.min, keep a 0/1 tensor
        for sub, fill_value in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            fill = const_scalar(fill_value)
            sub_node = producer(sub, "Sub")
            if fill is None or sub_node is None or const_scalar(sub_node.inputs[0]) != 1.0:
                continue
            keep = sub_node.inputs[1]
            cast = producer(keep, "Cast")
            if cast is None:
                continue
            meaning = bool_meaning(keep, sd, term.value)
            return _invert(meaning), fill
    return None


def _invert(meaning: BoolMeaning) -> BoolMeaning:
    if meaning.kind == "other":
        return meaning
    if meaning.kind in ("none", "all"):  # masks nothing <-> masks everything
        return BoolMeaning("all" if meaning.kind == "none" else "none")
    return BoolMeaning(meaning.kind, meaning.source, not meaning.inverted)


def _masks_nothing(term: Term, sd: ScoreDims) -> bool:
    """A term that provably leaves every score as it is (a zero bias, an all-keep mask)."""
    if term.mode == "add":
        if const_fill(term.value) == 0.0:
            return True
        found = bias_meaning(term, sd)
        return found is not None and found[0].kind == "none"
    meaning = bool_meaning(term.value, sd)
    if not term.masked_when:
        meaning = _invert(meaning)
    return meaning.kind == "none"


def plan(terms: list[Term], sd: ScoreDims, nan_to_zero: bool) -> MaskPlan:
    """Reduce the terms of one block to the kind that picks its fused form."""
    terms = [t for t in terms if not _masks_nothing(t, sd)]
    if not terms:
        return MaskPlan("none")
    if len(terms) == 1:
        term = terms[0]
        if term.mode == "replace":
            meaning = bool_meaning(term.value, sd)
            if not term.masked_when:
                meaning = _invert(meaning)
            fill = term.fill * term.post
        else:
            found = bias_meaning(term, sd)
            meaning, fill = (found[0], found[1] * term.post) if found else (BoolMeaning("other"), 0.0)
        if meaning.kind in ("causal", "key_padding") and (fill <= REMOVES_KEY or fill == -math.inf):
            if meaning.kind == "causal":
                return MaskPlan("causal", fill=fill, mode=term.mode)
            return MaskPlan("key_padding", fill=fill, mode=term.mode, padding=meaning)
    for term in terms:
        if term.mode == "replace" and not (term.fill * term.post <= ABSORBING):
            return MaskPlan(
                "unsupported",
                reason=f"masked_fill with the finite value {term.fill:g} combined with other "
                "masks: fully masked rows could not be reproduced exactly",
            )
    return MaskPlan("bias", terms=tuple(terms))
