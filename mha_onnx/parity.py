"""``validate``: parity of a model across PyTorch, ORT CPU, CUDA and TensorRT.

References: the PyTorch reference rebuilt from an mha-onnx export's metadata and weights, and/or
another ONNX model (``--reference``, e.g. the unfused original) on ORT CPU. Every requested
provider runs every shape case; statistics per output x provider x shape x reference. Fully
masked rows (every key padded) are reported apart with each runtime's behaviour; any other
NaN/Inf fails. A provider that cannot run is reported with ORT's reason, never replaced.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mha_onnx import metadata
from mha_onnx.config import MhaConfig
from mha_onnx.errors import EXIT_MISMATCH, EXIT_OK, EXIT_PROVIDER, InputSpecError, MhaOnnxError
from mha_onnx.graphio import read_model
from mha_onnx.inputs import InputSpec, ShapeCase, case_for, ensure_fits, input_specs, make_inputs
from mha_onnx.metadata import CheckResult
from mha_onnx.runtimes import OrtRunner, ProviderError, node_placement
from mha_onnx.stats import ErrorStats, compare, default_tolerance
from mha_onnx.table import table

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerance:
    """Bounds for one output (or all, name "*"): |got - want| <= atol + rtol * |want|."""

    atol: float | None = None
    rtol: float | None = None


@dataclass(frozen=True)
class ValidateConfig:
    providers: tuple[str, ...] = ("cpu",)
    shapes: tuple[ShapeCase, ...] | None = None
    tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    seed: int = 0
    allow_missing: bool = False
    reference: str | None = None
    threads: int | None = None
    memory_check: bool = True

    def tolerance_for(self, output: str, dtype: np.dtype) -> tuple[float, float]:
        default_atol, default_rtol = default_tolerance(dtype)
        chosen = self.tolerances.get(output) or self.tolerances.get("*") or Tolerance()
        return (default_atol if chosen.atol is None else chosen.atol,
                default_rtol if chosen.rtol is None else chosen.rtol)


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

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "output": self.output, "rows": self.rows,
                "behaviour": self.behaviour}


@dataclass(frozen=True)
class ProviderStatus:
    provider: str
    ran: bool
    reason: str = ""
    cpu_nodes: tuple[str, ...] = ()
    io_binding: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "ran": self.ran, "reason": self.reason,
                "nodes_on_cpu": list(self.cpu_nodes), "io_binding": self.io_binding}


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

    @property
    def outputs_passed(self) -> bool:
        return all(c.stats.passed for c in self.comparisons) and all(c.passed for c in self.checks)

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
        }

    def render(self) -> str:
        lines = [f"validate {self.model}", f"  references: {'; '.join(self.references) or 'none'}"]
        for p in self.providers:
            state = "ran" if p.ran else ("MISSING (allowed)" if self.allow_missing else "COULD NOT RUN")
            extra = f": {p.reason}" if p.reason else ""
            lines.append(f"  provider {p.provider}: {state}{extra}")
            if p.cpu_nodes:
                lines.append(f"    nodes that fell back to the CPU: {', '.join(p.cpu_nodes[:12])}"
                             + (" ..." if len(p.cpu_nodes) > 12 else ""))
        for c in self.checks:
            lines.append(f"  check {c.name}: {'pass' if c.passed else 'FAIL'}: {c.detail}")
        rows = [
            (c.output, c.provider, c.against, c.case, c.stats.max_abs, c.stats.max_rel,
             c.stats.mean_abs, c.stats.p99_abs, c.stats.mismatch_fraction, c.stats.cosine,
             f"{c.stats.nan_actual}/{c.stats.inf_actual}", "pass" if c.stats.passed else "FAIL")
            for c in self.comparisons
        ]
        if rows:
            lines.append(table(["output", "provider", "vs", "shape", "max abs", "max rel",
                                "mean abs", "p99 abs", "mismatch", "cosine", "nan/inf", "result"],
                               rows))
        for m in self.masked_rows:
            seen = ", ".join(f"{k} {v}" for k, v in m.behaviour.items())
            lines.append(f"  fully masked rows ({m.case}, {m.output}, {m.rows}): {seen}")
        for c in self.failures()[:5]:
            lines.append(
                f"  FAIL {c.output} on {c.provider} vs {c.against} at {c.case}: max abs error "
                f"{c.stats.max_abs:.3g} > atol {c.stats.atol:g} (+ rtol {c.stats.rtol:g}); "
                f"would need atol {c.stats.needed_atol:.3g}")
        verdict = {EXIT_OK: "PASSED", EXIT_MISMATCH: "FAILED: outputs differ",
                   EXIT_PROVIDER: "FAILED: a requested provider could not run"}[self.exit_code]
        lines.append(f"  result: {verdict} ({self.seconds:.1f} s)")
        return "\n".join(lines)


# -- references ---------------------------------------------------------------------------------

class TorchReference:
    """The PyTorch reference rebuilt from an export's metadata and initializers (float32)."""

    def __init__(self, source: onnx.ModelProto, label: str) -> None:
        import torch
        from onnx import numpy_helper

        from mha_onnx.reference import build_reference
        from mha_onnx.weights import checksum

        meta = metadata.read(source)
        self.config = MhaConfig.from_dict(json.loads(meta["config"]))
        params = json.loads(meta["params"])
        arrays = {t.name: t for t in source.graph.initializer}
        state = {}
        for name, where in params.items():
            tensor = arrays.get(where["initializer"])
            if tensor is None:
                raise MhaOnnxError(f"{label}: initializer {where['initializer']!r} of {name} is missing",
                                   hint="the file was rewritten in a way mha-onnx cannot follow")
            array = numpy_helper.to_array(tensor).astype(np.float32)
            state[name] = torch.from_numpy(np.ascontiguousarray(array.T if where["transposed"] else array))
        self.module = build_reference(self.config.replace(dtype="float32"), state)
        self.digest_ok = checksum(state) == meta.get("weights_sha256")
        self.label = label

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from mha_onnx.reference import run_reference

        return {"output": run_reference(self.module, dict(feeds))}


# -- the run ----------------------------------------------------------------------------------------

def validation_cases(specs: Sequence[InputSpec]) -> list[ShapeCase]:
    """The default sweep: seq 1, odd lengths, powers of two, seq_q != seq_kv, batch 1 and > 1;
    padding patterns include all-but-one key masked and a fully masked batch entry."""
    return [
        case_for(specs, "seq 1", 1, [1], "none"),
        case_for(specs, "odd", 1, [7, 5], "some"),
        case_for(specs, "pow2", 2, [16, 32], "some"),
        case_for(specs, "odd, padded", 3, [33, 17], "full"),
        case_for(specs, "pow2, long", 2, [128, 64], "full"),
    ]


def _fully_masked(specs: Sequence[InputSpec], feeds: Mapping[str, np.ndarray]) -> tuple[str, list[int]] | None:
    """(batch dim name, batch indices) whose mask input marks every key masked."""
    for spec in specs:
        array = feeds[spec.name]
        if spec.role != "mask" or array.ndim != 2 or not isinstance(spec.dims[0], str):
            continue
        padded = array if spec.dtype == np.bool_ else array == 0
        rows = [b for b in range(array.shape[0]) if padded[b].all()]
        if rows:
            return spec.dims[0], rows
    return None


def _behaviour(values: np.ndarray) -> str:
    if np.isnan(values).all():
        return "NaN"
    if np.isnan(values).any():
        return "partly NaN"
    if not np.isfinite(values).all():
        return "Inf"
    return "zeros" if not values.any() else "finite"


def _cast_feeds(feeds: Mapping[str, np.ndarray], specs: Sequence[InputSpec] | None) -> dict[str, np.ndarray]:
    if specs is None:
        return dict(feeds)
    by_name = {s.name: s for s in specs}
    return {k: v.astype(by_name[k].dtype) if k in by_name else v for k, v in feeds.items()}


def validate_model(path: str | Path, config: ValidateConfig) -> ValidationReport:
    """Compare ``path`` on every requested provider against the available references."""
    started = time.perf_counter()
    model = read_model(path)
    specs = input_specs(model)
    cases = list(config.shapes) if config.shapes else validation_cases(specs)
    if config.memory_check:  # the model, PyTorch and the reference run at once
        ensure_fits(model, cases, copies=3, hint="use smaller --shapes or pass --no-memory-check")
    references, labels, checks, ref_specs = _references(model, str(path), config)
    runners, statuses = _start_providers(str(path), config, make_inputs(specs, cases[0], seed=config.seed))
    out_dims = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]
                for o in model.graph.output}
    comparisons: list[Comparison] = []
    masked: list[MaskedRows] = []
    try:
        for n, case in enumerate(cases):
            feeds = make_inputs(specs, case, seed=config.seed + n)
            wants = {key: ref.infer(_cast_feeds(feeds, ref_specs) if key == "reference" else feeds)
                     for key, ref in references.items()}
            gots = {p: r.infer(feeds) for p, r in runners.items()}
            special = _fully_masked(specs, feeds)
            comparisons += _compare_case(case, gots, wants, special, out_dims, config)
            if special is not None:
                masked += _masked_rows(case, gots, wants, special, out_dims)
    finally:
        for runner in runners.values():
            runner.close()
    return ValidationReport(
        model=str(path), references=tuple(labels), providers=tuple(statuses),
        comparisons=tuple(comparisons), masked_rows=tuple(masked), checks=tuple(checks),
        allow_missing=config.allow_missing, seconds=time.perf_counter() - started,
    )


def _references(model: onnx.ModelProto, path: str, config: ValidateConfig):
    """{"pytorch": TorchReference, "reference": OrtRunner}, their labels, integrity checks and
    the reference model's input specs. The PyTorch reference comes from ``--reference``'s
    metadata when it has some, so a modified file cannot vouch for itself."""
    references: dict[str, Any] = {}
    labels: list[str] = []
    checks: list[CheckResult] = []
    ref_model = read_model(config.reference) if config.reference else None
    ref_specs = input_specs(ref_model) if ref_model is not None else None
    specs = input_specs(model)
    if ref_specs is not None and [s.name for s in ref_specs] != [s.name for s in specs]:
        raise InputSpecError(
            f"--reference {config.reference} has inputs {[s.name for s in ref_specs]}, the model "
            f"has {[s.name for s in specs]}")
    source = None
    if ref_model is not None and "config" in metadata.read(ref_model):
        source = (ref_model, f"PyTorch reference rebuilt from {config.reference}")
    elif "config" in metadata.read(model):
        source = (model, f"PyTorch reference rebuilt from {path}")
    if source is not None:
        torch_ref = TorchReference(*source)
        references["pytorch"] = torch_ref
        labels.append(f"pytorch = {torch_ref.label}")
        detail = ("weights match the checksum recorded at export" if torch_ref.digest_ok else
                  "weights differ from the checksum recorded at export (the file was modified "
                  "after export)")
        checks.append(CheckResult("weights", torch_ref.digest_ok, detail))
        own = metadata.read(model).get("weights_sha256")
        if source[0] is not model and own and own != metadata.read(ref_model).get("weights_sha256"):
            checks.append(CheckResult("same export", False,
                                      "model and --reference record different weights"))
    if ref_model is not None:
        references["reference"] = OrtRunner(ref_model.SerializeToString(), "cpu",
                                            threads=config.threads)
        labels.append(f"reference = {config.reference} on ORT CPU")
    if not references:
        raise MhaOnnxError(
            f"{path} has no mha-onnx metadata to rebuild the PyTorch reference from",
            hint="pass --reference ORIGINAL.onnx (e.g. the unfused model)")
    return references, labels, checks, ref_specs


def _start_providers(path: str, config: ValidateConfig, probe_feeds: dict[str, np.ndarray]):
    """A runner per provider that starts; a status per provider (ORT's reason when it does
    not; the nodes ORT put on the CPU under another provider when it does)."""
    statuses: list[ProviderStatus] = []
    runners: dict[str, OrtRunner] = {}
    for provider in config.providers:
        runner = OrtRunner(path, provider, threads=config.threads,
                           io_binding=provider != "cpu", strict=False)
        try:
            runner.session  # noqa: B018
        except ProviderError as exc:
            statuses.append(ProviderStatus(provider, False, str(exc)))
            continue
        cpu_nodes: tuple[str, ...] = ()
        if provider != "cpu":
            placement = node_placement(path, provider, probe_feeds)
            cpu_nodes = tuple(sorted(f"{name} ({op})" for name, (op, where) in placement.items()
                                     if where == "cpu"))
        runners[provider] = runner
        statuses.append(ProviderStatus(provider, True, cpu_nodes=cpu_nodes,
                                       io_binding=runner.io_binding))
    return runners, statuses


def _compare_case(case: ShapeCase, gots, wants, special, out_dims, config: ValidateConfig) -> list[Comparison]:
    """Statistics per output x provider x reference, fully masked batch entries left out."""
    out = []
    for provider, got in gots.items():
        for output, actual in got.items():
            for key, want in wants.items():
                if output not in want:
                    continue
                a, e = actual, want[output]
                if special is not None and special[0] in out_dims.get(output, []):
                    axis = out_dims[output].index(special[0])
                    keep = [b for b in range(actual.shape[axis]) if b not in special[1]]
                    a, e = np.take(actual, keep, axis=axis), np.take(e, keep, axis=axis)
                atol, rtol = config.tolerance_for(output, actual.dtype)
                out.append(Comparison(output, provider, key, case.describe(),
                                      compare(a, e, atol=atol, rtol=rtol)))
    return out


def _masked_rows(case: ShapeCase, gots, wants, special, out_dims) -> list[MaskedRows]:
    """What each runtime gives for the batch entries whose keys are all masked."""
    out = []
    batch_dim, rows = special
    for name, dims_ in out_dims.items():
        if batch_dim not in dims_:
            continue
        axis = dims_.index(batch_dim)
        seen = {key: _behaviour(np.take(want[name], rows, axis=axis))
                for key, want in wants.items() if name in want}
        for provider, got in gots.items():
            seen[f"ort {provider}"] = _behaviour(np.take(got[name], rows, axis=axis))
        out.append(MaskedRows(case.describe(), name, f"batch entries {rows}", seen))
    return out


def parse_tolerances(atol: Sequence[str], rtol: Sequence[str]) -> dict[str, Tolerance]:
    """``["1e-3", "logits=1e-2"]`` -> {"*": ..., "logits": ...}."""
    out: dict[str, dict[str, float]] = {}
    for kind, items in (("atol", atol), ("rtol", rtol)):
        for item in items:
            name, _, value = item.rpartition("=")
            try:
                number = float(value)
            except ValueError:
                raise InputSpecError(f"malformed --{kind} {item!r}",
                                     hint=f"use --{kind} 1e-4 or --{kind} OUTPUT=1e-4") from None
            if not math.isfinite(number) or number < 0:
                raise InputSpecError(f"--{kind} must be a non-negative number, got {item!r}")
            out.setdefault(name or "*", {})[kind] = number
    return {k: Tolerance(v.get("atol"), v.get("rtol")) for k, v in out.items()}
