"""Semantics check after rewriting: original and fused graph on ORT CPU, same inputs, at
shapes other than any export example (every dynamic dim varied, masks with padding, a fully
padded batch entry), compared with a dtype-aware tolerance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from mha_onnx.inputs import ShapeCase, default_cases, input_specs, iter_feeds
from mha_onnx.runtimes import OrtRunner
from mha_onnx.stats import ErrorStats, compare


@dataclass(frozen=True)
class CaseResult:
    case: str
    output: str
    stats: ErrorStats

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "output": self.output, **self.stats.to_dict()}


@dataclass(frozen=True)
class Verification:
    results: tuple[CaseResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.stats.passed for r in self.results)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def worst(self) -> CaseResult | None:
        return max(self.results, key=lambda r: r.stats.max_abs, default=None)

    def first_failure(self) -> CaseResult | None:
        return next((r for r in self.results if not r.stats.passed), None)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "results": [r.to_dict() for r in self.results]}


def verify(
    original: onnx.ModelProto,
    fused: onnx.ModelProto,
    *,
    cases: Sequence[ShapeCase] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    threads: int | None = None,
) -> Verification:
    """Run both models on the same generated inputs and compare every output."""
    specs = input_specs(original)
    cases = list(cases) if cases is not None else default_cases(specs)
    results = []
    with OrtRunner(original.SerializeToString(), "cpu", threads=threads) as before, OrtRunner(
        fused.SerializeToString(), "cpu", threads=threads
    ) as after:
        for case, feeds in iter_feeds(specs, cases):
            want = before.infer(feeds)
            got = after.infer(feeds)
            for name, expected in want.items():
                stats = compare(got[name], expected, atol=atol, rtol=rtol)
                results.append(CaseResult(case.describe(), name, stats))
    return Verification(tuple(results))
