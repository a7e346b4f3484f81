"""What ``validate`` answers: comparisons per output x provider x shape x reference, the
behaviour of fully masked rows, provider statuses and integrity checks; a table or JSON."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from mha_onnx.errors import EXIT_MISMATCH, EXIT_OK, EXIT_PROVIDER
from mha_onnx.graph.metadata import CheckResult
from mha_onnx.stats import ErrorStats
from mha_onnx.table import table


@dataclass(frozen=True)
class Comparison:
    output: str
    provider: str
    against: str
    case: str
    stats: ErrorStats

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "provider": self.provider, "against": self.against,
                "case": self.case, **self.stats.to_dict()}


@dataclass(frozen=True)
class MaskedRows:
    """Outputs of queries whose keys are all masked, per runtime ("NaN", "zeros", "finite")."""

    case: str
    output: str
    rows: str
    behaviour: dict[str, str]
    compared: tuple[str, ...] = ()  # the references these rows were compared with too

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ProviderStatus:
    provider: str
    ran: bool
    reason: str = ""
    cpu_nodes: tuple[str, ...] = ()
    io_binding: bool = False
    runtime: str = ""  # what ran it, where it is not ORT's CPU (OpenVINO, its precision)

    def to_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "ran": self.ran, "reason": self.reason,
                "nodes_on_cpu": list(self.cpu_nodes), "io_binding": self.io_binding,
                "runtime": self.runtime}


@dataclass(frozen=True)
class ValidationReport:
    model: str
    references: tuple[str, ...]
    providers: tuple[ProviderStatus, ...]
    comparisons: tuple[Comparison, ...]
    masked_rows: tuple[MaskedRows, ...]
    checks: tuple[CheckResult, ...]
    allow_missing: bool
    seconds: float
    notes: tuple[str, ...] = ()  # warnings: attention kernels on the CPU, forms for another EP
    bisect: Any = None  # --bisect: a BisectReport, or why nothing was bisected (str)
    decode_kernels: tuple[str, ...] = ()  # "decode step 1: GroupQueryAttention x2", ...
    ranges: Any = None  # --ranges: activation ranges against float16's (ranges.Ranges)

    @property
    def outputs_passed(self) -> bool:
        return all(c.stats.passed for c in self.comparisons) and all(
            c.passed for c in self.checks) and (self.ranges is None or self.ranges.passed)

    @property
    def providers_ran(self) -> bool:
        return self.allow_missing or all(p.ran for p in self.providers)

    @property
    def exit_code(self) -> int:
        if not self.outputs_passed:
            return EXIT_MISMATCH
        if not self.providers_ran:
            return EXIT_PROVIDER
        return EXIT_OK

    def __bool__(self) -> bool:
        return self.exit_code == EXIT_OK

    def failures(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.stats.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "passed": bool(self),
            "exit_code": self.exit_code,
            "references": list(self.references),
            "providers": [p.to_dict() for p in self.providers],
            "comparisons": [c.to_dict() for c in self.comparisons],
            "fully_masked_rows": [m.to_dict() for m in self.masked_rows],
            "checks": [c.to_dict() for c in self.checks],
            "seconds": round(self.seconds, 3),
            **({"bisect": self.bisect if isinstance(self.bisect, str) else self.bisect.to_dict()}
               if self.bisect is not None else {}),
            "notes": list(self.notes),
            "decode_kernels": list(self.decode_kernels),
            **({"ranges": self.ranges.to_dict()} if self.ranges is not None else {}),
        }

    def render(self, detail: bool = False) -> str:
        """The verdict, providers, checks, failures and a summary (one row per output kind,
        provider and reference, the worst over the cases); ``detail``: every comparison and
        every fully masked row (``validate -v``)."""
        lines = [f"validate {self.model}", f"  references: {'; '.join(self.references) or 'none'}"]
        for p in self.providers:
            state = "ran" if p.ran else ("MISSING (allowed)" if self.allow_missing else "COULD NOT RUN")
            extra = f": {p.reason}" if p.reason else (f" ({p.runtime})" if p.runtime else "")
            lines.append(f"  provider {p.provider}: {state}{extra}")
            if p.cpu_nodes:
                lines.append(f"    nodes that fell back to the CPU: {', '.join(p.cpu_nodes[:12])}"
                             + (" ..." if len(p.cpu_nodes) > 12 else ""))
        for c in self.checks:
            lines.append(f"  check {c.name}: {'pass' if c.passed else 'FAIL'}: {c.detail}")
        lines += [f"  kernels run on ORT CPU at {step}" for step in self.decode_kernels]
        lines += self._comparisons(detail)
        for m in self.masked_rows if detail else self.masked_rows[:1]:
            seen = ", ".join(f"{k} {v}" for k, v in m.behaviour.items())
            how = (f"; compared with {', '.join(m.compared)} as every row" if m.compared
                   else "; not compared (PyTorch's kernels differ among themselves there)")
            lines.append(f"  fully masked rows ({m.case}, {m.output}, {m.rows}): {seen}{how}")
        if len(self.masked_rows) > 1 and not detail:
            lines.append(f"  ... fully masked rows in {len(self.masked_rows) - 1} more case(s) "
                         "(-v lists them)")
        for c in self.failures()[:5]:
            lines.append(
                f"  FAIL {c.output} on {c.provider} vs {c.against} at {c.case}: max abs error "
                f"{c.stats.max_abs:.3g} > atol {c.stats.atol:g} (+ rtol {c.stats.rtol:g}); "
                f"would need atol {c.stats.needed_atol:.3g}")
        if isinstance(self.bisect, str):
            lines.append(f"  bisect: {self.bisect}")
        elif self.bisect is not None:
            lines.extend(self.bisect.render())
        if self.ranges is not None:
            lines.extend(self.ranges.render())
        lines.extend(f"  warning: {n}" for n in self.notes)
        differ = "outputs differ" if any(not c.stats.passed for c in self.comparisons) or any(
            not c.passed for c in self.checks) else "an activation overflows float16 (ranges)"
        verdict = {EXIT_OK: "PASSED", EXIT_MISMATCH: f"FAILED: {differ}",
                   EXIT_PROVIDER: "FAILED: a requested provider could not run"}[self.exit_code]
        lines.append(f"  result: {verdict} ({self.seconds:.1f} s)")
        return "\n".join(lines)

    def _comparisons(self, detail: bool) -> list[str]:
        """Every comparison (``detail``), else one row per output kind (layers' outputs
        together: present.N.key), provider and reference: the worst over its cases."""
        if not self.comparisons:
            return []
        head = ["output", "provider", "vs", "shape", "max abs", "max rel", "mean abs",
                "p99 abs", "mismatch", "cosine", "nan/inf", "result"]
        if detail:
            return [table(head, [
                (c.output, c.provider, c.against, c.case, c.stats.max_abs, c.stats.max_rel,
                 c.stats.mean_abs, c.stats.p99_abs, c.stats.mismatch_fraction, c.stats.cosine,
                 f"{c.stats.nan_actual}/{c.stats.inf_actual}",
                 "pass" if c.stats.passed else "FAIL") for c in self.comparisons])]
        groups: dict[tuple[str, str, str], list[Comparison]] = {}
        for c in self.comparisons:
            groups.setdefault((re.sub(r"\d+", "N", c.output), c.provider, c.against),
                              []).append(c)
        rows = []
        for (output, provider, against), found in groups.items():
            stats = [c.stats for c in found]
            rows.append((output, provider, against, f"{len({c.case for c in found})} cases",
                         max(x.max_abs for x in stats), max(x.max_rel for x in stats),
                         max(x.mean_abs for x in stats), max(x.p99_abs for x in stats),
                         max(x.mismatch_fraction for x in stats), min(x.cosine for x in stats),
                         f"{sum(x.nan_actual for x in stats)}/{sum(x.inf_actual for x in stats)}",
                         "pass" if all(x.passed for x in stats) else
                         f"FAIL ({sum(not x.passed for x in stats)})"))
        lines = [table(head, rows), f"  {len(self.comparisons)} comparisons, the worst of "
                 "each row's cases shown (-v: every one)"]
        steps = {c.case for c in self.comparisons if c.case.startswith("decode step ")}
        if steps:  # decode chains: how far they went
            last = max(int(case.split()[-1]) for case in steps)
            lines.append(f"  decoded: a prompt and {last} steps, each runtime on its own "
                         f"cache, compared at every step (decode step 1 .. decode step {last})")
        return lines
