"""Semantics check after rewriting: original and fused graph on ORT CPU, same inputs, at
shapes other than any export example (every dynamic dim varied, masks with padding, a fully
padded batch entry), compared with a dtype-aware tolerance."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mha_onnx.errors import FuseBug, FusionError, MhaOnnxError, ModelFileError, VerifyError
from mha_onnx.graph.cache import SharedCache, cache_pairs, is_shared, row_layout
from mha_onnx.graph.files import write_model
from mha_onnx.graph.inputs import (
    ShapeCase,
    case_of_feeds,
    default_cases,
    input_specs,
    iter_feeds,
)
from mha_onnx.rewrite.check.routes import chosen_as_inputs, chosen_as_outputs, routes
from mha_onnx.runtime.ort import OrtRunner
from mha_onnx.stats import ErrorStats, compare

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaseResult:
    case: str
    output: str
    stats: ErrorStats
    dtype: str = ""  # the output's element type (numpy's name)

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "output": self.output, **self.stats.to_dict()}


@dataclass(frozen=True)
class Verification:
    results: tuple[CaseResult, ...]
    reference: str = "onnxruntime CPU"
    skipped: tuple[str, ...] = ()  # optional cases the original itself cannot run
    routes_held: tuple[str, ...] = ()  # routers fed the original's choice (routes.py)

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
        return {"passed": self.passed, "reference": self.reference,
                "results": [r.to_dict() for r in self.results], "skipped": list(self.skipped),
                "routes_held": list(self.routes_held)}


def verify(
    original: onnx.ModelProto,
    fused: onnx.ModelProto,
    *,
    cases: Sequence[ShapeCase] | None = None,
    given: Mapping[str, np.ndarray] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    threads: int | None = None,
    levels: tuple[str, str] = ("all", "all"),
    scratch: Path | None = None,
    fused_file: Path | None = None,
) -> Verification:
    """Run both models on the same inputs (``given`` ones, else generated ``cases``) and
    compare every output; ``levels``: the ORT optimisation level of each model. A fused
    model with a shared KV cache runs on its own buffers behind the original's (appended)
    interface. One session at a time: the original's outputs on every case first. With a
    ``scratch`` folder each model is a file there with its weights as external data
    (``fused_file``: the fused one, written already) and its session reads them in place,
    unpacked: a session from bytes holds the bytes and a packed copy of every MatMul's
    weight, so that two sessions of a large model held six times its weights."""
    specs = input_specs(original)
    runs = _runs(specs, cases, given)
    held = routes(original, fused)
    with chosen_as_outputs(original, held) as added, chosen_as_inputs(fused, held):
        before = _Original(original, threads, levels[0], _written(original, scratch, "original"))
        wants, skipped = _expected(runs, before, [r.chosen for r in held], added, scratch)
        before.close()
        source = (fused_file if not held else None) or _written(fused, scratch, "fused") \
            or fused.SerializeToString()  # (routers' choices fed: inputs the file lacks)
        runner = OrtRunner(source, "cpu", threads=threads, optimization=levels[1],
                           prepacking=scratch is None)
        _loads(runner, before)
        with runner:
            after = SharedCache(runner, specs, cache_pairs(fused), rows=row_layout(fused)) \
                if is_shared(fused) else runner
            results = _compare(wants, after, atol, rtol)
    return Verification(tuple(results), before.label, tuple(skipped),
                        tuple(r.node.name or r.chosen for r in held))


def _written(model: onnx.ModelProto, scratch: Path | None, name: str) -> Path | None:
    """``model`` as ``scratch/name.onnx`` with its weights beside it, or None without one."""
    if scratch is None:
        return None
    return write_model(model, scratch / f"{name}.onnx", force=True, external=True)


def _loads(runner: OrtRunner, before: _Original) -> None:
    """A fused graph ORT refuses to load is fuse's bug, unless it refuses the original too."""
    try:
        runner.session  # noqa: B018
    except MhaOnnxError as exc:
        refused = before.refused_to_load()
        if refused is not None:  # the input is what is broken
            raise ModelFileError(
                f"onnxruntime refuses the original model, so the fused one (which keeps "
                f"its other nodes) cannot load either: {refused}",
                hint="re-export it (a float16 TorchScript export may mix float32 and "
                     "float16 inputs of one op); nothing was written") from exc
        raise _fuse_bug("does not load in ORT", exc) from exc


def _expected(runs, before: _Original, chosen: list[str], added: list[str],
              scratch: Path | None) -> tuple[list, list]:
    """The original's outputs on every case: [(case, feeds, outputs, the routers' choices
    to feed the fused graph)], and the optional cases it does not run. ``chosen``: the
    routers' indices the original gives and the fused graph is fed (routes.py), ``added``:
    those not outputs of the model. With ``scratch``, large outputs wait there (mapped)."""
    wants, skipped = [], []
    for n, (case, feeds) in enumerate(runs):
        try:
            want = before.infer(feeds, fall_back=not case.optional)
        except MhaOnnxError as exc:
            if not case.optional:
                raise
            skipped.append(f"{case.describe()}: the original does not run there ({exc})")
            continue
        held = {name: want[name] for name in chosen}
        for name in added:
            del want[name]
        wants.append((case, feeds, _kept(want, scratch, n), held))
    return wants, skipped


def _kept(outputs: dict[str, np.ndarray], scratch: Path | None, n: int) -> dict:
    """``outputs``, those of a MiB or more saved in ``scratch`` and read back mapped."""
    if scratch is None:
        return outputs
    kept = {}
    for k, (name, value) in enumerate(outputs.items()):
        if isinstance(value, np.ndarray) and value.nbytes >= 1 << 20 and value.dtype.kind in "fiub":
            path = scratch / f"expected_{n}_{k}.npy"
            np.save(path, value)
            value = np.load(path, mmap_mode="r")
        kept[name] = value
    return kept


def _compare(wants, after, atol: float | None, rtol: float | None) -> list:
    """Every case's outputs of the fused graph against the original's."""
    results = []
    for case, feeds, want, held in wants:
        try:
            got = after.infer({**feeds, **held})
        except MhaOnnxError as exc:  # fuse wrote a graph ORT cannot run: our bug
            raise _fuse_bug(f"does not run on ORT CPU at {case.describe()}", exc) from exc
        for name, expected in want.items():
            stats = compare(got[name], np.asarray(expected), atol=atol, rtol=rtol)
            results.append(CaseResult(case.describe(), name, stats, np.dtype(got[name].dtype).name))
    return results


def _runs(specs, cases: Sequence[ShapeCase] | None, given: Mapping[str, np.ndarray] | None):
    """(case, feeds) to verify with: the ``given`` inputs, else generated ``cases`` (default:
    the default cases of ``specs``)."""
    if given is not None:
        return [(case_of_feeds(specs, dict(given), "given inputs"), dict(given))]
    return list(iter_feeds(specs, list(cases) if cases is not None else default_cases(specs)))


class _Original:
    """Runs the original on ORT CPU; a graph ORT refuses (e.g. torch's opset-23 Attention
    with a [B, 1, 1, T] mask) runs on the ONNX reference evaluator instead, which follows
    the spec. ``file``: the original written with its weights beside it (its session reads
    them in place), else the session is made from its bytes."""

    def __init__(self, model: onnx.ModelProto, threads: int | None, level: str,
                 file: Path | None = None) -> None:
        self.model = model
        self.make = lambda: OrtRunner(file if file is not None else model.SerializeToString(),
                                      "cpu", threads=threads, optimization=level,
                                      prepacking=file is None)
        self.runner: OrtRunner | None = self.make()
        self.evaluator: Any = None
        self.label = "onnxruntime CPU"
        self.refused = ""

    def close(self) -> None:
        """The session given back (the outputs were read); the evaluator kept."""
        if self.runner is not None:
            self.runner.close()

    def refused_to_load(self) -> MhaOnnxError | None:
        """ORT's refusal to load the original, or None where it loads."""
        try:
            with self.make():
                return None
        except MhaOnnxError as exc:
            return exc

    def infer(self, feeds: dict[str, Any], fall_back: bool = True) -> dict[str, Any]:
        """``fall_back=False``: an ORT failure is raised (sizes the model may refuse)."""
        if self.runner is not None:
            try:
                return self.runner.infer(feeds)
            except MhaOnnxError as exc:
                if not fall_back:
                    raise
                log.warning("original does not run on ORT CPU (%s); using the ONNX reference "
                            "evaluator", exc)
                self.runner = None
                self.refused = str(exc)
                self.label = f"ONNX reference evaluator (ORT CPU refused the original: {exc})"
        names = [o.name for o in self.model.graph.output]
        try:
            if self.evaluator is None:  # (it refuses contrib operators as it is built)
                from onnx.reference import ReferenceEvaluator

                self.evaluator = ReferenceEvaluator(self.model)
            values = self.evaluator.run(None, dict(feeds))
        except Exception as exc:  # noqa: BLE001 - the evaluator raises anything
            raise VerifyError(
                f"cannot run the original model to verify against: ORT CPU refused it "
                f"({_gist(self.refused)}) and ONNX's reference evaluator raised "
                f"{type(exc).__name__}: {_gist(str(exc))}",
                hint="pass inputs it runs on with --inputs FILE.npz; --no-verify skips the "
                     "check (not recommended)",
            ) from exc
        return dict(zip(names, values, strict=True))


def _gist(message: str) -> str:
    """A runtime's message without its boilerplate: ORT's status message alone, the first
    sentence of others."""
    said = message.split("Status Message: ", 1)[-1]
    return said.split(". ", 1)[0][:200]


def _fuse_bug(what: str, exc: Exception) -> FusionError:
    """A fused graph ORT refuses is fuse's bug (exit 4), neither the user's bad input (2)
    nor outputs that differ (1)."""
    return FuseBug(f"the fused graph {what}: {exc}; nothing was written",
                       hint="please report this model (fuse --no-verify writes it anyway)")


def verify_on_openvino(original: onnx.ModelProto, fused: onnx.ModelProto, on_ort: Verification,
                       *, cases: Sequence[ShapeCase] | None = None,
                       given: Mapping[str, np.ndarray] | None = None,
                       atol: float | None = None, rtol: float | None = None) -> Verification:
    """``fuse --target openvino``: the fused graph on OpenVINO (f32 pinned) against the
    original on ORT CPU, case by case, added to ``on_ort``. Each case compiles the fused graph
    afresh, so that what is checked is the rewrite: OpenVINO 2026.4.1 keeps shape-specialised
    state across runs of one compiled model that can change later results (a run at one token
    then a batch of two, docs/history/bench-notebook.md), which `validate --providers openvino` shows as it is."""
    from mha_onnx.runtime.openvino import OpenVinoRunner

    runs = _runs(input_specs(original), cases, given)
    results = list(on_ort.results)
    held = routes(original, fused)
    with chosen_as_outputs(original, held) as added, chosen_as_inputs(fused, held):
        before, graph = _Original(original, None, "all"), fused.SerializeToString()
        for case, feeds in runs:
            try:
                want = before.infer(feeds, fall_back=not case.optional)
            except MhaOnnxError:
                continue  # said by the ORT pass already
            chosen = {r.chosen: want[r.chosen] for r in held}
            with OpenVinoRunner(graph, "openvino") as runner:
                got = runner.infer({**feeds, **chosen})
            for name, expected in want.items():
                if name not in added:
                    results.append(CaseResult(f"{case.describe()} on OpenVINO f32", name,
                                              compare(got[name], expected, atol=atol,
                                                      rtol=rtol)))
    return Verification(tuple(results), on_ort.reference, on_ort.skipped, on_ort.routes_held)
