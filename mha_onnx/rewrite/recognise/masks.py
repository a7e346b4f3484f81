"""What the masks between Q·K^T and the Softmax are made of.

A block's mask terms (``scores + bias``, ``Where(cond, fill, scores)``) are taken apart into
pieces, one recogniser per spelling:

- boolean trees: ``And`` of keep-masks and ``Or`` of masked-masks (a union of masked keys),
  ``Not``, ``Equal(x, 0)``, ``Cast``, layout ops (Reshape, Unsqueeze, Expand, Hugging Face's
  broadcasting ``GatherND``);
- float spellings of a boolean: ``Where(c, 0, fill)``, ``(1 - keep) * fill``,
  ``Cast(c) * fill``, sums of those;
- leaves that depend on tensor sizes only (``triu``/``tril``, arange comparisons, cached
  lower-triangular buffers, position biases): :class:`SizeLeaf`, whose values the oracle
  evaluates at several sizes (:mod:`mha_onnx.rewrite.recognise.oracle`);
- leaves that depend on input values: a ``[B, T]`` tensor broadcast over queries is key
  padding (:class:`Padding`); anything else is not understood (``reason``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from mha_onnx.rewrite.irutil import (
    WALK_LIMIT,
    Dim,
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
    lift: int = 0  # the value is [B*H, ..]: split its first dim into [B, lift] for the scores


@dataclass(frozen=True)
class ScoreDims:
    batch: Dim
    heads: Dim
    seq_q: Dim
    seq_kv: Dim
    rank: int


@dataclass(frozen=True)
class Padding:
    """Key padding: ``source`` [B, T] (or [B, 1, T], [B, 1, 1, T]); a key is masked where
    ``source != 0``, or where it is 0 when ``inverted`` (a keep mask such as Hugging Face's
    ``attention_mask``)."""

    source: ir.Value
    inverted: bool


@dataclass(frozen=True)
class SizeLeaf:
    """A piece whose value depends on sizes only. Boolean: masked where it equals
    ``masked_when``. Float (``masked_when`` None): added to the scores times ``post``."""

    value: ir.Value
    masked_when: bool | None
    post: float = 1.0
    fill: float = 0.0  # boolean leaves: the score their masked keys get
    lift: int = 0  # as Term.lift


@dataclass(frozen=True)
class Pieces:
    """The pieces of every mask term of one block."""

    size: tuple[SizeLeaf, ...] = ()
    padding: tuple[tuple[Padding, float], ...] = ()  # (padding, fill)
    reason: str = ""  # non-empty: a piece was not understood
    merged: tuple[SizeLeaf, ...] = ()  # float biases added with batch and heads merged


def _rank(value: ir.Value | None) -> int | None:
    shape = dims(value)
    return None if shape is None else len(shape)


# -- layout ------------------------------------------------------------------------------------

def strip_layout(value: ir.Value) -> tuple[ir.Value, bool]:
    """Follow Reshape/Unsqueeze/rank-keeping Expand/Identity/broadcast GatherND up;
    (source, whether only layout ops were met)."""
    current = value
    for _ in range(WALK_LIMIT):
        node = producer(current, *LAYOUT_OPS)
        if node is None:
            return current, True
        if node.op_type == "Expand" and _rank(node.inputs[0]) != _rank(node.outputs[0]):
            return current, False
        if node.op_type == "GatherND" and not is_broadcast_gather(node):
            return current, False
        current = node.inputs[0]
    return current, False


def arange_axis(value: ir.Value | None) -> int | None:
    """The axis along which ``value`` is ``0, 1, 2, ...`` (Range(0, n, 1) unsqueezed and
    expanded into a larger shape), or None."""
    path = []
    current = value
    for _ in range(8):
        node = producer(current, "Unsqueeze", "Expand", "Cast", "Reshape")
        if node is None:
            break
        path.append(node)
        current = node.inputs[0]
    rng = producer(current, "Range")
    if rng is None or const_scalar(rng.inputs[0]) != 0 or const_scalar(rng.inputs[2]) != 1:
        return None
    axis, rank_now = 0, 1
    for node in reversed(path):  # follow the arange's axis down to ``value``
        if node.op_type == "Reshape":  # only one non-1 dim: that is where the arange went
            shape = const_ints(node.inputs[1])
            big = [n for n, d in enumerate(shape or []) if d != 1]
            if shape is None or len(big) != 1:
                return None
            axis, rank_now = big[0], len(shape)
        elif node.op_type == "Unsqueeze":
            axes = const_ints(node.inputs[1])
            if axes is None:
                return None
            rank_now += len(axes)
            for a in sorted(x % rank_now for x in axes):
                if a <= axis:
                    axis += 1
        elif node.op_type == "Expand":  # broadcasting prepends dims
            out_rank = _rank(node.outputs[0])
            if out_rank is None or out_rank < rank_now:
                return None
            axis, rank_now = axis + out_rank - rank_now, out_rank
    return axis


def is_broadcast_gather(node: ir.Node) -> bool:
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
        planes.append(arange_axis(squeeze.inputs[0]))
    return planes == [0, out_rank - 1]


def key_axis_only(value: ir.Value, sd: ScoreDims) -> bool:
    """Could ``value`` be a [B, T] padding broadcast over the scores: keys on its last axis,
    no other axis a length (batch and heads may be merged or broadcast)? A first screen: the
    padding is then proven by evaluation (:meth:`Oracle.padding_agrees`)."""
    shape = dims(value)
    if shape is None or sd.rank != 4 or not 2 <= len(shape) <= 4:
        return False
    lengths = {sd.seq_q, sd.seq_kv} - {None, 1}
    return same_dim(shape[-1], sd.seq_kv) and not any(d in lengths for d in shape[:-1])


def padding_leaf(outer: ir.Value, source: ir.Value, sd: ScoreDims, masked_when: bool
                 ) -> Padding | None:
    """Key padding: ``source`` a [B, T] tensor (or a [B, 1, T], [B, 1, 1, T] model input: a
    mask already shaped to broadcast, as some seq2seq exports take it) that reaches ``outer``
    through layout and value-keeping ops only, ``outer`` broadcast onto the scores over
    queries (and heads)."""
    source, layout_ok = strip_layout(source)
    shape = dims(source)
    if not layout_ok or shape is None or not 2 <= len(shape) <= 4 or source.dtype is None:
        return None
    if len(shape) > 2 and (any(d != 1 for d in shape[1:-1]) or not source.is_graph_input()):
        return None  # computed [B, 1, 1, T] values are proven by evaluation (value_masks.py)
    if not (same_dim(shape[0], sd.batch) and same_dim(shape[-1], sd.seq_kv)):
        return None
    if not key_axis_only(outer, sd):
        return None
    kind_ok = (source.dtype == ir.DataType.BOOL or source.dtype.is_integer()
               or source.dtype.is_floating_point())
    return Padding(source, inverted=not masked_when) if kind_ok else None


# -- taking terms apart --------------------------------------------------------------------------

class _Collector:
    """Collects the pieces of a block's terms; ``size_only`` says which values depend on
    tensor sizes alone (the oracle's judgement)."""

    def __init__(self, sd: ScoreDims, size_only: Callable[[ir.Value], bool]) -> None:
        self.sd = sd
        self.size_only = size_only
        self.size: list[SizeLeaf] = []
        self.padding: list[tuple[Padding, float]] = []
        self.reasons: list[str] = []
        self.merged: list[SizeLeaf] = []

    def result(self) -> Pieces:
        return Pieces(tuple(self.size), tuple(self.padding), "; ".join(dict.fromkeys(self.reasons)),
                      tuple(self.merged))

    def term(self, term: Term) -> None:
        if term.lift and merged_bias(term):  # BLOOM's ALiBi on [B*H, 1, T]: added as it is
            self.merged.append(SizeLeaf(term.value, None, term.post, lift=term.lift))
        elif term.lift:  # a masked fill on [B*H, S, T]: kept with the rest (a dense bias)
            self.reasons.append("a mask applied with batch and heads merged")
        elif term.mode == "replace":
            self.boolean(term.value, term.masked_when, term.fill * term.post, 0)
        else:
            self.additive(term.value, term.post, 0)

    def boolean(self, value: ir.Value, masked_when: bool, fill: float, depth: int,
                outer: ir.Value | None = None) -> None:
        """``value`` masks keys where it equals ``masked_when`` (0/1 tensors included);
        ``outer`` is the value the scores see when ``value`` sits under value-keeping ops."""
        if depth > WALK_LIMIT:
            self.reasons.append("mask expression too deep")
            return
        if self.size_only(value):
            self.size.append(SizeLeaf(value, masked_when, fill=fill))
            return
        outer = value if outer is None else outer
        inner, layout_ok = strip_layout(value)
        node = producer(inner) if layout_ok else None
        op = node.op_type if node is not None else ""
        if op in ("Not", "Cast") or (op == "Equal" and _zero_operand(node) is not None):
            flips = op != "Cast"
            nxt = node.inputs[0] if op != "Equal" else _zero_operand(node)  # type: ignore[union-attr]
            self.boolean(nxt, masked_when != flips, fill, depth + 1, outer)  # type: ignore[arg-type]
        elif (op == "And" and not masked_when) or (op == "Or" and masked_when):
            for part in node.inputs:  # type: ignore[union-attr]
                self.boolean(part, masked_when, fill, depth + 1)
        elif _is_float(inner) and (spelled := _boolean_spelling(node)) is not None:
            # a float mask read as a boolean (MPT: Cast(Where(keep, 0, min), bool)): nonzero,
            # i.e. True, exactly where its condition equals the spelling's polarity
            cond, nonzero_when, _ = spelled
            self.boolean(cond, nonzero_when if masked_when else not nonzero_when, fill,
                         depth + 1, outer)
        else:
            self._data_leaf(outer, value, masked_when, fill)

    def _data_leaf(self, outer: ir.Value, value: ir.Value, masked_when: bool, fill: float) -> None:
        found = padding_leaf(outer, value, self.sd, masked_when)
        if found is None:
            self.reasons.append("a mask that depends on input values and is not a [B, T] key "
                                "padding broadcast over queries")
        else:
            self.padding.append((found, fill))

    def additive(self, value: ir.Value, post: float, depth: int) -> None:
        """A float tensor added to the scores (then scaled by ``post``)."""
        if const_fill(value) == 0.0:
            return
        if self.size_only(value):
            self.size.append(SizeLeaf(value, None, post))
            return
        inner, layout_ok = strip_layout(value)
        node = producer(inner) if layout_ok else None
        op = node.op_type if node is not None else ""
        if op == "Add" and depth < WALK_LIMIT:
            for part in node.inputs:  # type: ignore[union-attr]
                self.additive(part, post, depth + 1)
            return
        if op == "Cast" and _is_float(node.inputs[0]) and depth < WALK_LIMIT:
            self.additive(node.inputs[0], post, depth + 1)  # a float16 mask added in float32
            return
        found = _boolean_spelling(node) if node is not None else None
        if found is None:
            self.reasons.append("an additive bias that depends on input values")
            return
        cond, masked_when, fill = found
        self.boolean(cond, masked_when, fill * post, depth + 1, outer=value)


def _is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype is not None and value.dtype.is_floating_point()


def _zero_operand(node: ir.Node | None) -> ir.Value | None:
    """For ``Equal(x, 0)`` (either order): x."""
    if node is None or node.op_type != "Equal":
        return None
    a, b = node.inputs
    if const_scalar(b) == 0.0:
        return a
    if const_scalar(a) == 0.0:
        return b
    return None


def _boolean_spelling(node: ir.Node) -> tuple[ir.Value, bool, float] | None:
    """A float mask spelled from a boolean: (condition, masked_when, fill)."""
    if node.op_type == "Where":
        cond, a, b = node.inputs
        ca, cb = const_fill(a), const_fill(b)
        if ca is not None and cb == 0.0 and ca != 0.0:
            return cond, True, ca
        if cb is not None and ca == 0.0 and cb != 0.0:
            return cond, False, cb
        return None
    if node.op_type != "Mul":
        return None
    for sub, fill_value in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        fill = const_scalar(fill_value)
        if fill is None or fill == 0.0 or math.isnan(fill):
            continue
        sub_node = producer(sub, "Sub")
        if sub_node is not None and const_scalar(sub_node.inputs[0]) == 1.0:  # (1 - keep) * fill
            return sub_node.inputs[1], False, fill
        cast = producer(sub, "Cast")
        if cast is not None and cast.inputs[0] is not None and cast.inputs[0].dtype == ir.DataType.BOOL:
            return cast.inputs[0], True, fill  # Cast(masked) * fill
    return None


def merged_bias(term: Term) -> bool:
    """A float tensor added to [B*H, S, T] scores that is not a mask spelled from a boolean:
    a bias (ALiBi as BLOOM adds it with baddbmm), exact wherever it is added as it is."""
    value = term.value
    if term.mode != "add" or value.dtype is None or not value.dtype.is_floating_point():
        return False
    inner, layout_ok = strip_layout(value)
    node = producer(inner) if layout_ok else None
    return node is None or _boolean_spelling(node) is None


def take_apart(terms: list[Term], sd: ScoreDims, size_only: Callable[[ir.Value], bool]) -> Pieces:
    """The pieces of ``terms``; see the module docstring."""
    collector = _Collector(sd, size_only)
    for term in terms:
        collector.term(term)
    return collector.result()
