"""How far a quantized model is from its float original, as figures a user can judge: per
output the max and mean absolute error and the cosine; for a decoder the next-token
distributions' KL divergence and top-1 agreement over every prompt position of a batch,
and how many greedy tokens agree over a generation; and which MatMuls cost the most (each
quantized alone). Thresholds with documented defaults turn the figures into a verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mha_onnx.errors import ConfigError
from mha_onnx.table import table

PROMPTS, PROMPT_LENGTH, NEW_TOKENS = 4, 64, 32
GREEDY_FROM = 16  # greedy generation starts from each prompt's first tokens


@dataclass(frozen=True)
class Thresholds:
    """The verdict's bounds. ``max_kl``: mean KL(float || quantized) of the next-token
    distributions, nats; ``min_top1``: share of positions whose argmax agrees;
    ``min_cosine``: mean cosine of every output's rows; ``min_greedy``: mean share of a
    row's greedy tokens that agree before the first difference (None: reported only, as a
    random model's near ties make it fall fast)."""

    max_kl: float = 0.05
    min_top1: float = 0.80
    min_cosine: float = 0.95
    min_greedy: float | None = None

    def __post_init__(self) -> None:
        if self.max_kl < 0 or not 0 <= self.min_top1 <= 1 or not -1 <= self.min_cosine <= 1 \
                or (self.min_greedy is not None and not 0 <= self.min_greedy <= 1):
            raise ConfigError("thresholds out of range",
                              hint="--max-kl >= 0; --min-top1, --min-greedy in [0, 1]; "
                                   "--min-cosine in [-1, 1]")

    def to_dict(self) -> dict[str, Any]:
        return {"max_kl": self.max_kl, "min_top1": self.min_top1,
                "min_cosine": self.min_cosine, "min_greedy": self.min_greedy}


@dataclass(frozen=True)
class OutputError:
    output: str
    max_abs: float
    mean_abs: float
    cosine: float  # mean over the output's rows (its last axis)

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "max_abs": self.max_abs, "mean_abs": self.mean_abs,
                "cosine": self.cosine}


@dataclass(frozen=True)
class AccuracyReport:
    outputs: tuple[OutputError, ...]
    positions: int  # next-token positions compared (0: no logits)
    kl_mean: float | None = None
    kl_max: float | None = None
    top1: float | None = None
    greedy: float | None = None  # mean share of a row's tokens before the first difference
    greedy_rows: tuple[int, int] = (0, 0)  # rows identical over all tokens, rows
    greedy_tokens: int = 0
    sensitivity: tuple[tuple[str, float], ...] = ()  # (MatMul, KL quantized alone), worst first
    thresholds: Thresholds = Thresholds()
    notes: tuple[str, ...] = field(default=())

    def failures(self) -> list[str]:
        """What is past the thresholds, each with where."""
        t, out = self.thresholds, []
        if self.kl_mean is not None and self.kl_mean > t.max_kl:
            worst = f"; the most sensitive MatMul: {self.sensitivity[0][0]}" \
                if self.sensitivity else ""
            out.append(f"logits KL {self.kl_mean:.4g} > --max-kl {t.max_kl:g}{worst}")
        if self.top1 is not None and self.top1 < t.min_top1:
            out.append(f"top-1 agreement {self.top1:.3f} < --min-top1 {t.min_top1:g}")
        out += [f"{o.output}: cosine {o.cosine:.4f} < --min-cosine {t.min_cosine:g}"
                for o in self.outputs if o.cosine < t.min_cosine]
        if t.min_greedy is not None and self.greedy is not None and self.greedy < t.min_greedy:
            out.append(f"greedy agreement {self.greedy:.3f} < --min-greedy {t.min_greedy:g}")
        return out

    def __bool__(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict[str, Any]:
        return {"passed": bool(self), "failures": self.failures(),
                "outputs": [o.to_dict() for o in self.outputs], "positions": self.positions,
                "kl_mean": self.kl_mean, "kl_max": self.kl_max, "top1": self.top1,
                "greedy": self.greedy, "greedy_identical_rows": list(self.greedy_rows),
                "greedy_tokens": self.greedy_tokens,
                "sensitivity": [{"matmul": n, "kl": k} for n, k in self.sensitivity],
                "thresholds": self.thresholds.to_dict(), "notes": list(self.notes)}

    def render(self, indent: str = "  ") -> list[str]:
        lines = []
        if self.positions:
            lines.append(f"{indent}next token over {self.positions} positions: KL mean "
                         f"{self.kl_mean:.4g} (max {self.kl_max:.4g}) nats, top-1 agreement "
                         f"{self.top1:.3f}")
        if self.greedy is not None:
            lines.append(f"{indent}greedy, {self.greedy_tokens} tokens x "
                         f"{self.greedy_rows[1]} prompts: {self.greedy:.3f} of each row "
                         f"before the first difference, {self.greedy_rows[0]} row(s) "
                         "identical")
        lines.append(table(["output", "max abs", "mean abs", "cosine"],
                           [(o.output, o.max_abs, o.mean_abs, o.cosine) for o in self.outputs],
                           indent=indent))
        if self.sensitivity:
            lines.append(f"{indent}most sensitive MatMuls (logits KL, each quantized alone): "
                         + ", ".join(f"{n} {k:.3g}" for n, k in self.sensitivity[:5]))
        lines += [f"{indent}FAIL {f}" for f in self.failures()]
        lines += [f"{indent}note: {n}" for n in self.notes]
        return lines


def kl_top1(want: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(softmax(want) || softmax(got)) and whether the argmaxes agree."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(want), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return kl, want.argmax(-1) == got.argmax(-1)


def output_error(name: str, want: np.ndarray, got: np.ndarray) -> OutputError:
    a, b = want.astype(np.float64), got.astype(np.float64)
    rows_a, rows_b = a.reshape(-1, a.shape[-1] or 1), b.reshape(-1, b.shape[-1] or 1)
    norms = np.linalg.norm(rows_a, axis=1) * np.linalg.norm(rows_b, axis=1)
    dots = (rows_a * rows_b).sum(axis=1)
    cosine = np.where(norms > 0, dots / np.where(norms > 0, norms, 1), 1.0)
    diff = np.abs(a - b)
    return OutputError(name, float(diff.max(initial=0)), float(diff.mean()) if diff.size
                       else 0.0, float(cosine.mean()) if cosine.size else 1.0)


def greedy_agreement(want: Sequence[Sequence[int]], got: Sequence[Sequence[int]]
                     ) -> tuple[float, int]:
    """(mean share of each row before its first difference, rows identical)."""
    shares, same = [], 0
    for a, b in zip(want, got, strict=True):
        n = max(len(a), len(b), 1)
        prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                      min(len(a), len(b)))
        shares.append(prefix / n)
        same += list(a) == list(b)
    return float(np.mean(shares)), same


def compare(want: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray],
            mask: np.ndarray | None = None) -> tuple[list[OutputError], dict[str, Any]]:
    """Every output's error; for ``logits``, KL and top-1 over the positions ``mask`` keeps
    (bool [B, S]; all where None)."""
    errors = [output_error(name, want[name], got[name]) for name in want if name in got]
    figures: dict[str, Any] = {}
    if "logits" in want and "logits" in got:
        kl, agree = kl_top1(want["logits"], got["logits"])
        if mask is not None and mask.shape == kl.shape:
            kl, agree = kl[mask], agree[mask]
        figures = {"positions": int(kl.size), "kl_mean": float(kl.mean()),
                   "kl_max": float(kl.max()), "top1": float(agree.mean())}
    return errors, figures


def sensitivity(matmuls: Sequence[str], logits_of: Callable[[str], np.ndarray],
                want: np.ndarray) -> tuple[tuple[str, float], ...]:
    """Each MatMul quantized alone (``logits_of(name)``): the logits' mean KL against the
    float model's ``want``, worst first."""
    found = [(name, float(kl_top1(want, logits_of(name))[0].mean())) for name in matmuls]
    return tuple(sorted(found, key=lambda item: -item[1]))
