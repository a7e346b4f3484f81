"""``--mixed auto``: the fewest of the most sensitive MatMuls kept wider (int8, or float
where int8 is not enough or the weights are 8 bits already) for the accuracy gate to pass.

The MatMuls are ranked once (each weight quantized alone: sensitivity.py). A trial
quantizes the whole model with the N highest ranked weights wider and measures it as the
gate does. N doubles from 1 until a trial passes, then the gap to the last failing N is
halved until it closes: the N chosen passes and N - 1 was measured failing. "Fewest" is
within the ranking's order (another set of N - 1 weights might pass; trying sets is
exponential). Each trial costs one quantization and one accuracy run of the whole model.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mha_onnx.quantize.accuracy import AccuracyReport
from mha_onnx.quantize.config import QuantizeConfig


@dataclass(frozen=True)
class Trial:
    kept: int  # how many of the ranked weights were kept wider
    form: str  # int8 | float
    report: AccuracyReport

    @property
    def passed(self) -> bool:
        return bool(self.report)

    def line(self) -> str:
        figures = [f"KL {self.report.kl_mean:.4g}"] if self.report.kl_mean is not None else []
        figures += [f"top-1 {self.report.top1:.3f}"] if self.report.top1 is not None else []
        return (f"--mixed auto: {self.kept} in {self.form}: "
                f"{'pass' if self.passed else 'fail'}" + (f" ({', '.join(figures)})"
                                                          if figures else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"kept": self.kept, "form": self.form, "passed": self.passed,
                "kl_mean": self.report.kl_mean, "top1": self.report.top1}


@dataclass(frozen=True)
class Search:
    """What ``--mixed auto`` tried and chose: ``config`` quantizes with the ``kept``
    highest ranked weights (``weights``) in ``form``; ``kept`` is None where no count
    passed (``config`` is then the one given)."""

    config: QuantizeConfig
    form: str
    kept: int | None
    weights: tuple[str, ...]
    trials: tuple[Trial, ...]

    def note(self, label: Callable[[str], str] = str) -> str:
        """One line; ``label``: how a weight is named (e.g. by its MatMul)."""
        tried = ", ".join(f"{t.kept}{f' {t.form}' if t.kept else ''} "
                          f"{'pass' if t.passed else 'fail'}" for t in self.trials)
        if self.kept is None:
            return (f"--mixed auto: no count of the most sensitive weights kept wider passed "
                    f"the thresholds (tried {tried})")
        if not self.kept:
            return "--mixed auto: the quantization passes as it is; nothing kept wider"
        return (f"--mixed auto: the {self.kept} most sensitive weight(s) in {self.form} "
                f"pass the thresholds, {self.kept - 1} did not (tried {tried}): "
                + ", ".join(label(w) for w in self.weights))


def forms(config: QuantizeConfig) -> tuple[str, ...]:
    """The wider forms to try, in order: int8 first where the weights are 4 bits by RTN or
    GPTQ (its int8 weights are RTN's; HQQ has no 8 bits), then float."""
    return ("int8", "float") if config.bits == 4 and config.algorithm != "hqq" else ("float",)


def widened(config: QuantizeConfig, form: str, weights: Sequence[str]) -> QuantizeConfig:
    """``config`` with ``weights`` (names, matched literally) in ``form``."""
    names = tuple(glob.escape(w) for w in weights)
    if form == "int8":
        return replace(config, int8=config.int8 + names)
    return replace(config, exclude=config.exclude + names)


def least(config: QuantizeConfig, ranked: Sequence[str], first: AccuracyReport,
          measure: Callable[[QuantizeConfig], AccuracyReport],
          progress: Callable[[str], None] = lambda _: None) -> Search:
    """The search over ``ranked`` (weight names, most sensitive first); ``first``: the
    report with none kept wider; ``measure``: a config's accuracy report."""
    if first or not ranked:
        return Search(config, forms(config)[0], 0 if first else None, (),
                      (Trial(0, forms(config)[0], first),))
    trials = [Trial(0, forms(config)[0], first)]
    for form in forms(config):
        def passes(n: int, form: str = form) -> bool:
            trials.append(Trial(n, form, measure(widened(config, form, ranked[:n]))))
            progress(trials[-1].line())
            return trials[-1].passed

        kept = _bisect(len(ranked), passes)
        if kept is not None:
            chosen = tuple(ranked[:kept])
            return Search(widened(config, form, chosen), form, kept, chosen, tuple(trials))
    return Search(config, forms(config)[-1], None, (), tuple(trials))


def _bisect(count: int, passes: Callable[[int], bool]) -> int | None:
    """The least n in 1..count for which ``passes`` (taken as monotone; 0 fails), by
    doubling then halving; None where ``count`` fails too."""
    low, high = 0, 1
    while not passes(high):
        if high >= count:
            return None
        low, high = high, min(2 * high, count)
    while high - low > 1:
        middle = (low + high) // 2
        if passes(middle):
            high = middle
        else:
            low = middle
    return high
