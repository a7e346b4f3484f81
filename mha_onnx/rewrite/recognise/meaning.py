"""The meaning of one block's mask: causal (with its window and alignment), key padding,
position biases, or a dense bias that only the general form reproduces. Built from the
pieces of :mod:`mha_onnx.rewrite.recognise.masks` and the oracle's verdict on the size-only ones."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mha_onnx.rewrite.recognise.masks import (
    ABSORBING,
    REMOVES_KEY,
    Padding,
    ScoreDims,
    SizeLeaf,
    Term,
    take_apart,
)
from mha_onnx.rewrite.recognise.oracle import Oracle


class Unsupported(Exception):
    """A mask no fused form reproduces exactly (the block stays as it is)."""


@dataclass(frozen=True)
class Causal:
    """Query i sees keys ``j <= i`` (top-left; ``j <= i + T - S`` bottom-right; "square" when
    S == T always), only the last ``window`` of them when ``window`` > 0."""

    window: int = 0
    alignment: str = "square"


@dataclass(frozen=True)
class MaskMeaning:
    causal: Causal | None = None
    padding: Padding | None = None
    biases: tuple[SizeLeaf, ...] = ()  # position biases: added to the scores as they are
    terms: tuple[Term, ...] = ()  # every term as found: the dense form adds them all
    fill: float = -math.inf  # the weakest score a masked key gets
    mode: str = "add"  # "replace": masked scores are overwritten (fully masked rows: mean of V)
    reason: str = ""  # non-empty: only the dense form is exact (why)
    merged: tuple[SizeLeaf, ...] = ()  # biases added with batch and heads merged (ALiBi)

    @property
    def added(self) -> tuple[SizeLeaf, ...]:
        """Every bias added to the scores as it is: position biases and merged ones."""
        return self.biases + self.merged

    @property
    def kind(self) -> str:
        """none | causal | key_padding | bias (dense): the family that picks the form."""
        if self.reason:
            return "bias"
        if self.causal is not None:
            return "causal"
        if self.added:
            return "bias"
        return "key_padding" if self.padding is not None else "none"

    def describe(self) -> str:
        """Human words for the mask, e.g. ``causal + key padding, window 4096``."""
        if self.reason:
            return f"dense bias ({self.reason})"
        parts = []
        if self.causal is not None:
            align = "" if self.causal.alignment == "square" else f" ({self.causal.alignment})"
            parts.append(f"causal{align}")
        if self.padding is not None:
            parts.append("key padding")
        if self.biases:
            parts.append("position bias")
        if self.merged:
            parts.append("bias on merged heads (ALiBi-style)")
        text = " + ".join(parts) or "none"
        if self.causal is not None and self.causal.window:
            text += f", window {self.causal.window}"
        return text

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "causal": self.causal is not None,
            "alignment": self.causal.alignment if self.causal else None,
            "window": self.causal.window if self.causal else 0,
            "key_padding": self.padding is not None,
            "position_bias": bool(self.biases),
            "merged_bias": bool(self.merged),
            "dense_reason": self.reason or None,
        }


def _dense(terms: list[Term], reason: str) -> MaskMeaning:
    """Only the dense form; refused when even that cannot reproduce fully masked rows."""
    _finite_fill_alone(terms)
    return MaskMeaning(terms=tuple(terms), reason=reason)


def _finite_fill_alone(terms: list[Term]) -> None:
    """A masked_fill whose value does not absorb what other terms add (float16's -65504 under
    MPT's ALiBi) gives fully masked rows one equal score that no additive form reproduces."""
    for term in terms:
        if term.mode == "replace" and len(terms) > 1 and not term.fill * term.post <= ABSORBING:
            raise Unsupported(f"masked_fill with the finite value {term.fill:g} combined with "
                              "other masks: fully masked rows could not be reproduced exactly")


def plan(terms: list[Term], sd: ScoreDims, oracle: Oracle) -> MaskMeaning:
    """Reduce the terms of one block to their meaning."""
    if not terms:
        return MaskMeaning()
    _finite_fill_alone(terms)
    pieces = take_apart(terms, sd, oracle.size_only)
    if pieces.reason:
        return _evaluated(terms, sd, oracle, pieces.reason, pieces.merged)
    size = oracle.pattern(pieces.size, sd)
    if size.kind == "other":
        return _dense(terms, size.reason)
    padding = _one_padding(pieces.padding)
    if isinstance(padding, str):
        return _dense(terms, padding)
    fills = [fill for _, fill in pieces.padding] + ([size.fill] if size.kind == "causal" else [])
    weakest = max(fills, default=-math.inf)
    if fills and not (weakest <= REMOVES_KEY):
        return _dense(terms, f"masked keys get the score {weakest:g}, which does not remove them")
    masking = _masking(terms, pieces.merged)
    if padding:
        disagreement = oracle.padding_agrees(masking, pieces.size, padding[0], sd)
        if disagreement:
            return _dense(terms, disagreement)
    return _meaning(terms, size, padding[0] if padding else None, weakest, pieces.merged)


def _meaning(terms: list[Term], size, padding: Padding | None, fill: float,
             merged: tuple[SizeLeaf, ...] = ()) -> MaskMeaning:
    """The meaning of proven pieces: the size pattern's causality and biases, the padding."""
    causal = Causal(size.window, size.alignment) if size.kind == "causal" else None
    mode = "replace" if all(t.mode == "replace" for t in terms) else "add"
    meaning = MaskMeaning(causal, padding, size.biases, tuple(terms), fill, mode, merged=merged)
    if meaning.kind == "key_padding" and len(terms) > 1 and mode == "replace":
        return _dense(terms, "key padding spread over several masked fills")
    return meaning


def _masking(terms: list[Term], merged: tuple[SizeLeaf, ...]) -> list[Term]:
    """The terms that mask: all but the biases added on merged heads (kept as they are)."""
    return [t for t in terms if not any(t.value is m.value for m in merged)]


def _evaluated(terms: list[Term], sd: ScoreDims, oracle: Oracle, reason: str,
               merged: tuple[SizeLeaf, ...] = ()) -> MaskMeaning:
    """A mask whose pieces were not all understood one by one, judged as a whole: causal
    (or nothing) + key padding from one [B, T] input, proven by evaluation; else dense.
    ``merged``: biases added on merged heads (BLOOM's ALiBi), kept as they are and left out
    of the evaluation (the TorchScript BLOOM adds its 4-D mask after the heads split); so is
    a term that is a position bias alone (MPT's ALiBi table sliced to the keys, added per
    head before the TorchScript mask: proven by its own evaluation to mask nothing)."""
    masking = _masking(terms, merged)
    biases = _position_biases(masking, sd, oracle)
    masking = [t for t in masking if not any(t.value is b.value for b in biases)]
    found = oracle.value_mask(masking, sd) if masking else reason
    if isinstance(found, str):
        return _dense(terms, reason)
    size, padding, fill = found
    if not fill <= REMOVES_KEY:
        return _dense(terms, f"masked keys get the score {fill:g}, which does not remove them")
    return _meaning(terms, replace(size, biases=size.biases + biases), padding, fill, merged)


def _position_biases(terms: list[Term], sd: ScoreDims, oracle: Oracle) -> tuple[SizeLeaf, ...]:
    """The added terms that depend on sizes only and, evaluated, mask no key: biases."""
    leaves = tuple(SizeLeaf(t.value, None, t.post) for t in terms
                   if t.mode == "add" and not t.lift and oracle.size_only(t.value))
    if not leaves:
        return ()
    pattern = oracle.pattern(leaves, sd)
    return pattern.biases if pattern.kind == "none" and len(pattern.biases) == len(leaves) else ()


def _one_padding(found: tuple[tuple[Padding, float], ...]) -> tuple[Padding] | tuple[()] | str:
    """At most one key padding source (the same one met twice counts once)."""
    sources = {(id(p.source), p.inverted): p for p, _ in found}
    if len(sources) > 1:
        return "two different key paddings"
    return tuple(sources.values())  # type: ignore[return-value]
