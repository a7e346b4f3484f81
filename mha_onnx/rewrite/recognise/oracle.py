"""Mask pieces that depend on tensor sizes only, judged by evaluating them.

``triu``/``tril`` of ones, arange comparisons (Hugging Face's index-based mask builders
included), cached lower-triangular buffers sliced to ``[:S, :T]``, sliding windows and
position biases all compute a value from the *sizes* of the inputs, never from their values.
Such a piece is cut out of the graph (with ``onnx_ir.convenience.extract``) and run on ORT
CPU at several sizes: small distinct lengths (``S < T`` and ``S > T`` where the graph has two
length dims) and lengths beyond every integer constant the piece holds, so that a window of
4096 is not mistaken for plain causality. The verdict is what holds at every size tried:

- ``none``: nothing masked; ``causal``: query i sees keys ``j <= i + offset`` (top-left
  alignment: offset 0; bottom-right: ``T - S``), optionally only the last ``window`` of them;
- ``other``: any other pattern (a dense bias then). Float pieces whose unmasked values are not
  all zero are position biases (kept as an additive bias).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mha_onnx.graph.inputs import ShapeCase, padding_pattern
from mha_onnx.rewrite.irutil import subgraphs
from mha_onnx.rewrite.recognise import value_masks
from mha_onnx.rewrite.recognise.masks import REMOVES_KEY, Padding, ScoreDims, SizeLeaf, Term
from mha_onnx.rewrite.recognise.slices import (
    Refused,
    SliceRunner,
    assignments,
    input_symbols,
    resolve,
)

log = logging.getLogger(__name__)

BASE_LENGTHS = (5, 9, 17, 33)
MAX_LENGTH = 8192  # longest length a piece is evaluated at
IMPURE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
          "Bernoulli", "Dropout"}


@dataclass(frozen=True)
class SizePattern:
    """What the size-only pieces of one block mask, at every size tried."""

    kind: str  # "none" | "causal" | "other"
    window: int = 0  # causal: each query keeps only its last ``window`` keys (0: all)
    alignment: str = ""  # causal: "top-left" | "bottom-right" | "square" (S == T always)
    fill: float = -math.inf  # the weakest score a masked key gets
    biases: tuple[SizeLeaf, ...] = ()  # float pieces with non-zero unmasked values
    reason: str = ""


class Oracle:
    """Size-only judgement and evaluation over one graph (results cached per piece set)."""

    def __init__(self, model: ir.Model, max_length: int = MAX_LENGTH,
                 floors: dict[str, int] | None = None) -> None:
        self.model = model
        self.floors = floors or {}  # least sizes of input dims (a convolution stack's)
        self.graph = model.graph
        self.max_length = max_length
        self._size_only: dict[int, bool] = {}
        self._patterns: dict[tuple, SizePattern] = {}
        self._symbols = input_symbols(self.graph)

    # -- which values depend on sizes only ---------------------------------------------------

    def size_only(self, value: ir.Value | None) -> bool:
        """True when ``value`` depends on the inputs' sizes and constants, not their values."""
        if value is None:
            return True
        key = id(value)
        if key not in self._size_only:
            self._size_only[key] = self._judge(value)
        return self._size_only[key]

    def _judge(self, value: ir.Value) -> bool:
        stack, seen, result = [value], set(), True
        while stack:  # iterative: mask slices can be long
            current = stack.pop()
            if id(current) in seen:
                continue
            seen.add(id(current))
            if id(current) in self._size_only and current is not value:
                result = result and self._size_only[id(current)]
                continue
            node = current.producer()
            if node is None:
                if current.const_value is None and not current.is_initializer():
                    return False  # a graph input's values
                continue
            if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx"):
                continue
            if node.op_type in IMPURE or subgraphs(node):
                return False
            stack.extend(v for v in node.inputs if v is not None)
        return result

    # -- evaluating ---------------------------------------------------------------------------

    def pattern(self, leaves: Sequence[SizeLeaf], sd: ScoreDims) -> SizePattern:
        """Evaluate ``leaves`` at several sizes and say what they mask together."""
        if not leaves:
            return SizePattern("none")
        key = (tuple((id(leaf.value), leaf.masked_when, leaf.post, leaf.fill) for leaf in leaves),
               sd.seq_q, sd.seq_kv)
        if key not in self._patterns:
            try:
                self._patterns[key] = self._evaluate(list(leaves), sd)
            except Refused as exc:
                self._patterns[key] = SizePattern("other", reason=str(exc))
            except (ValueError, IndexError) as exc:  # sizes a piece cannot take (negative dims)
                self._patterns[key] = SizePattern(
                    "other", reason=f"the mask could not be evaluated at the sizes tried ({exc})")
        return self._patterns[key]

    def padding_agrees(self, terms: Sequence[Term], leaves: Sequence[SizeLeaf], padding: Padding,
                       sd: ScoreDims) -> str:
        """Do ``terms`` mask exactly the keys that ``leaves`` mask plus those ``padding``
        pads, for every batch entry, head and query? Evaluated with random padding patterns
        at several sizes; '' when they do, else why not."""
        try:
            runner = SliceRunner(self.model, [t.value for t in terms] + [x.value for x in leaves],
                                  set(self._symbols), fed=(padding.source,))
            rng = np.random.default_rng(0)
            for assignment in assignments(self._symbols, list(BASE_LENGTHS[:3]), self.floors):
                sizes = [resolve(d, assignment) for d in (sd.batch, sd.seq_q, sd.seq_kv)]
                if None in sizes:
                    return "the scores' dims cannot be related to the inputs' dims"
                b, s, t = sizes
                pattern = padding_pattern(b, t, ShapeCase("padding", {}, "full"), rng)
                source = _as_source(pattern, padding)
                arrays = runner.run(assignment, {runner.inputs_by_id[id(padding.source)]: source})
                reason = _compare_padding(terms, leaves, arrays, pattern, (b, s, t))
                if reason:
                    return reason
        except Refused as exc:
            return str(exc)
        except (ValueError, IndexError) as exc:  # sizes the pieces cannot take
            return f"the mask could not be evaluated at the sizes tried ({exc})"
        return ""

    def value_mask(self, terms: Sequence[Term], sd: ScoreDims
                   ) -> tuple[SizePattern, Padding, float] | str:
        """A mask computed from one [B, T] input's values, judged as a whole by evaluation
        (:mod:`mha_onnx.rewrite.recognise.value_masks`): its size-dependent part, the key padding and
        the weakest masked score; or why it is not that."""
        try:
            found = value_masks.evaluate(self.model, self._symbols, self._lengths, terms, sd,
                                         self.floors)
        except Refused as exc:
            return str(exc)
        except (ValueError, IndexError) as exc:  # sizes the mask cannot take
            return f"the mask could not be evaluated at the sizes tried ({exc})"
        observed = [_Observed(m, found.fill, ()) for m in found.masked]
        size = _classify(observed, [])
        if size.kind == "other":
            return size.reason
        return size, found.padding, found.fill

    def _evaluate(self, leaves: list[SizeLeaf], sd: ScoreDims) -> SizePattern:
        runner = SliceRunner(self.model, [leaf.value for leaf in leaves], set(self._symbols))
        constants = runner.constants()
        lengths = self._lengths(constants)
        observed = []
        for n, assignment in enumerate(assignments(self._symbols, lengths, self.floors)):
            try:
                observed.append(self._observe(runner, leaves, sd, assignment))
            except Refused:
                if n < len(BASE_LENGTHS):
                    raise
                # Past the constant the pieces no longer fit the scores: a table of that many
                # positions (MPT's ALiBi), so the model runs no longer either, and a window
                # as long is no window. Evaluated at the longest lengths within the table.
                observed.append(self._within_table(runner, leaves, sd, max(constants)))
        return _classify(observed, leaves)

    def _within_table(self, runner: SliceRunner, leaves: list[SizeLeaf], sd: ScoreDims,
                      table: int) -> _Observed:
        """The pieces at the longest lengths that fit a table of ``table`` positions: a key
        length that is a sum of dims (a past + new tokens) fits at half the base, and so on."""
        for parts in range(1, len(self._symbols) + 1):
            base = table // parts - 4 * len(self._symbols)
            if base <= BASE_LENGTHS[-1]:
                break
            within = assignments(self._symbols, [*BASE_LENGTHS, base], self.floors)[-1]
            try:
                return self._observe(runner, leaves, sd, within)
            except Refused:
                continue
        raise Refused(f"the mask pieces do not fit the scores at lengths within {table}")

    @staticmethod
    def _observe(runner: SliceRunner, leaves: list[SizeLeaf], sd: ScoreDims,
                 assignment: dict[str, int]) -> _Observed:
        s, t = resolve(sd.seq_q, assignment), resolve(sd.seq_kv, assignment)
        if s is None or t is None:
            raise Refused("the scores' lengths cannot be related to the inputs' dims")
        return _masked_and_biases(leaves, runner.run(assignment), s, t)

    def _lengths(self, constants: list[int]) -> list[int]:
        lengths = list(BASE_LENGTHS)
        if constants:
            beyond = max(constants) + 3
            if beyond > self.max_length:
                raise Refused(f"the mask uses the constant {max(constants)}; lengths beyond "
                               f"{self.max_length} are not evaluated, so a window cannot be "
                               "ruled out")
            lengths.append(max(beyond, BASE_LENGTHS[-1] + 2))
        return lengths


@dataclass(frozen=True)
class _Observed:
    masked: np.ndarray  # bool [S, T]
    fill: float  # weakest masked score
    bias_leaves: tuple[int, ...]  # indices of float leaves with non-zero unmasked values


def _trailing(array: np.ndarray, s: int, t: int) -> np.ndarray | None:
    """``array`` as [lead, S, T] if it broadcasts onto [..., S, T], else None."""
    if array.ndim < 2:
        array = array.reshape((1,) * (2 - array.ndim) + array.shape)
    tail = array.shape[-2:]
    if tail[0] not in (1, s) or tail[1] not in (1, t):
        return None
    full = np.broadcast_to(array, array.shape[:-2] + (s, t))
    return full.reshape(-1, s, t)


def _masked_and_biases(leaves: list[SizeLeaf], arrays: list[np.ndarray], s: int, t: int) -> _Observed:
    masked = np.zeros((s, t), dtype=bool)
    fills, biases = [], []
    for n, (leaf, array) in enumerate(zip(leaves, arrays, strict=True)):
        grid = _trailing(np.asarray(array), s, t)
        if grid is None:
            raise Refused(f"a mask piece of shape {list(np.shape(array))} does not match the "
                           f"scores' [.., {s}, {t}]")
        if leaf.masked_when is not None:
            here = grid == leaf.masked_when if grid.dtype == np.bool_ else (grid != 0) == leaf.masked_when
            fills.append(leaf.fill)
        else:
            scaled = grid.astype(np.float64) * leaf.post
            here = scaled <= REMOVES_KEY
            if here.any() and np.unique(scaled[here]).size > 1:
                # graded, not one fill (ALiBi's far keys at long lengths): a bias, added as
                # it is; masks fill their keys with one value
                here = np.zeros_like(here)
            if here.any():
                fills.append(float(scaled[here].max()))
            if np.any(scaled[~here] != 0):
                biases.append(n)
        if not (here == here[:1]).all():
            raise Refused("a mask piece masks differently per batch entry or head")
        masked |= here[0]
    return _Observed(masked, max(fills) if fills else -math.inf, tuple(biases))


def _causal_fit(masked: np.ndarray, offset: int) -> int | None:
    """The window (0: none) for which ``masked`` is causal with ``offset``, or None."""
    s, t = masked.shape
    i = np.arange(s)[:, None]
    j = np.arange(t)[None, :]
    causal = j > i + offset
    if not (masked >= causal).all():
        return None
    extra = masked & ~causal  # masked keys left of the diagonal: a window
    if not extra.any():
        return 0
    kept = (~masked).sum(axis=1)
    window = int(kept.max())
    if window == 0:  # every key masked: no causal pattern (a "window" of none is 0 = none)
        return None
    expected = causal | (j <= i + offset - window)
    return window if np.array_equal(masked, expected) else None


def _classify(observed: list[_Observed], leaves: list[SizeLeaf]) -> SizePattern:
    fill = max(o.fill for o in observed)
    biases = tuple(leaves[n] for n in sorted({n for o in observed for n in o.bias_leaves}))
    if not any(o.masked.any() for o in observed):
        return SizePattern("none", fill=fill, biases=biases)
    fits: dict[str, set[int]] = {"top-left": set(), "bottom-right": set()}
    for o in observed:
        s, t = o.masked.shape
        for name, offset in (("top-left", 0), ("bottom-right", t - s)):
            window = _causal_fit(o.masked, offset)
            fits[name].add(-1 if window is None else window)
    square = all(o.masked.shape[0] == o.masked.shape[1] for o in observed)
    for name in ("top-left", "bottom-right"):
        windows = fits[name]
        if -1 in windows:
            continue
        shown = {w for w in windows if w}
        if len(shown) > 1:
            continue
        window = shown.pop() if shown else 0
        return SizePattern("causal", window=window, alignment="square" if square else name,
                           fill=fill, biases=biases)
    return SizePattern("other", fill=fill, biases=biases,
                       reason="a size-dependent mask that is neither causal nor a causal window")


def _as_source(padded: np.ndarray, padding: Padding) -> np.ndarray:
    """The padding source's values for ``padded`` (a keep mask when ``inverted``)."""
    flags = ~padded if padding.inverted else padded
    dtype = padding.source.dtype
    rank = len(padding.source.shape or ()) or 2  # [B, 1, T]: the middle dims are 1
    flags = flags.reshape(flags.shape[0], *([1] * (rank - 2)), flags.shape[-1])
    return flags.astype(dtype.numpy() if dtype is not None else np.bool_)


def _term_masked(term: Term, array: np.ndarray) -> np.ndarray:
    if term.mode == "replace":
        flag = array if array.dtype == np.bool_ else array != 0
        return flag == term.masked_when
    return array.astype(np.float64) * term.post <= REMOVES_KEY


def _compare_padding(terms: Sequence[Term], leaves: Sequence[SizeLeaf], arrays: list[np.ndarray],
                     padded: np.ndarray, sizes: tuple[int, int, int]) -> str:
    b, s, t = sizes
    actual = np.zeros((b, 1, s, t), dtype=bool)
    try:
        for term, array in zip(terms, arrays, strict=False):
            masked = _term_masked(term, np.asarray(array))
            masked = masked.reshape((1,) * (4 - masked.ndim) + masked.shape)
            actual = actual | masked
        size = _masked_and_biases(list(leaves), arrays[len(terms):], s, t).masked
    except (ValueError, Refused) as exc:
        return f"the mask does not broadcast like a key padding ({exc})"
    expected = size[None, None] | padded[:, None, None, :]
    if not np.array_equal(actual, np.broadcast_to(expected, actual.shape)):
        return "the mask does not mask the keys its [B, T] padding says (checked by evaluation)"
    return ""