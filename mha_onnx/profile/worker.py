"""Timing one point, in this process or in a child process of its own (so that its peak
memory is its own and a crash inside ONNX Runtime cannot take the caller down).

A point is one or more models on one provider, batch, length and thread count. With several
models they run interleaved (A, B, A, B, ...) so that all of them see the same machine state
-- the way ratios are measured on shared, noisy machines. Public: :class:`PointSpec`,
:func:`measure`, :func:`in_child`, :func:`timed_loop` and the memory readers (used by
tools/bench.py for the PyTorch peers too).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.profile.feeds import Target, bound_run, cache_bytes, point_feeds, target

CONTROL_FLOW = ("Loop", "If", "Scan")


@dataclass(frozen=True)
class PointSpec:
    """What to time. ``iters``/``min_time``: at least that many runs and that long per
    model, after ``warmup`` runs."""

    models: tuple[str, ...]
    provider: str = "cpu"
    batch: int = 1
    seq_len: int = 128
    threads: int | None = None
    warmup: int = 3
    iters: int | None = 10
    min_time: float | None = 0.3
    io_binding: bool = False
    pad_fraction: float = 0.0
    op_breakdown: bool = False
    trace_dir: str | None = None
    inputs: str | None = None  # an .npz of feeds instead of generated ones
    decode: bool = False  # KV-cache model: one new token after ``seq_len`` cached positions



# -- memory ---------------------------------------------------------------------------------------

def rss() -> int:
    """Resident memory of this process now (psutil, or /proc/self/statm without it)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0), so that the peak read after the
    runs is theirs, not that of start-up (imports, session creation)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """VmHWM of this process (since the last reset), or ru_maxrss where /proc has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_used() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # noqa: BLE001 - NVML is optional
        return None


# -- timing -----------------------------------------------------------------------------------------

def timed_loop(runs: list[Callable[[], Any]], *, warmup: int, iters: int | None,
               min_time: float | None) -> list[list[float]]:
    """Seconds per run of each callable, interleaved, until each has ``iters`` runs and
    ``min_time`` seconds (defaults: 10 runs, or 3 when only a time is given). Each round
    starts one callable later than the last: in a fixed order, whichever runs first always
    follows the last one's work (docs/history/bench-notebook.md, "Each run's own noise floor")."""
    for run in runs:
        for _ in range(warmup):
            run()
    target = iters if iters else (3 if min_time else 10)
    times: list[list[float]] = [[] for _ in runs]
    spent = [0.0] * len(runs)
    rounds = 0
    while min(len(t) for t in times) < target or min(spent) < (min_time or 0.0):
        first = rounds % len(runs)
        rounds += 1
        for n in [*range(first, len(runs)), *range(first)]:
            run = runs[n]
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            times[n].append(elapsed)
            spent[n] += elapsed
        if len(times[0]) >= 100_000:
            break
    return times


def _feeds(spec: PointSpec, model: Target) -> dict[str, np.ndarray]:
    return point_feeds(model, spec.batch, spec.seq_len, decode=spec.decode,
                       pad_fraction=spec.pad_fraction, inputs=spec.inputs)


def _runner(spec: PointSpec, model: str, profile_dir: str | None = None):
    """A session as the model needs it (session options recorded in its metadata). Models
    timed in turn in one process get thread pools that sleep when idle: a spinning pool of
    one session would steal the cores of the next one's run."""
    from mha_onnx.graph.files import read_model
    from mha_onnx.graph.metadata import session_options
    from mha_onnx.runtime import make_runner

    needs = session_options(read_model(model, load_external_data=False))
    return make_runner(model, spec.provider, threads=spec.threads, io_binding=spec.io_binding,
                     strict=False, profile_dir=profile_dir,
                     optimization=needs.get("optimization", "all"),
                     spinning=len(spec.models) == 1)


def measure(spec: PointSpec, kept: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time ``spec`` in this process: per model its run times and session time; for one
    model also the peak memory of the runs and, if asked, the time per op. ``kept``: the
    sessions of earlier points of one grid by model, reused and left open (each made once:
    see :func:`measure_grid`)."""
    device0 = device_used() if spec.provider in ("cuda", "tensorrt") else None
    from mha_onnx.errors import ProviderError
    from mha_onnx.runtime import capabilities

    runners, runs, sessions, caches = [], [], {}, {}
    refused: dict[str, dict[str, str]] = {}
    for model in spec.models:
        start = time.perf_counter()
        runner = (kept or {}).get(model) or _runner(spec, model)
        try:  # one model a runtime refuses (OpenVINO and a contrib op) leaves the others timed
            runner.session  # noqa: B018
        except ProviderError as exc:
            refused[model] = {"error": str(exc)}
            continue
        sessions[model] = time.perf_counter() - start
        runners.append(runner)
        if kept is not None:
            kept[model] = runner
        form = target(model)
        feeds = _feeds(spec, form)
        run = bound_run(runner, feeds, form)
        try:  # a model that fails at this point fails alone (its rows), the others are timed
            run()
        except Exception as exc:  # noqa: BLE001 - ORT's own error types, whatever they are
            refused[model] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
            runners.pop()
            continue
        caches[model] = cache_bytes(feeds, form) if spec.decode else None
        runs.append(run)
    if not runs:
        return {"models": refused}
    rss_before = rss()
    reset_peak_rss()
    times = timed_loop(runs, warmup=spec.warmup, iters=spec.iters, min_time=spec.min_time)
    peak, device = peak_rss(), device_used()
    for runner in runners if kept is None else []:
        runner.close()
    timed = [m for m in spec.models if m not in refused]
    out: dict[str, Any] = {"models": {**{m: {"times": t, "session_s": sessions[m],
                                             "cache_bytes": caches[m]}
                                         for m, t in zip(timed, times, strict=True)}, **refused}}
    if len(spec.models) == 1:
        out.update(peak_rss=peak, run_rss=max(0, peak - rss_before),
                   device_bytes=None if device0 is None or device is None else max(0, device - device0))
    if (spec.op_breakdown or spec.trace_dir) and capabilities(spec.provider).op_profile:
        for model in timed:  # each model's own profiled runs, after the timing
            try:
                out["models"][model].update(_op_times(spec, model))
            except Exception as exc:  # noqa: BLE001 - the timing stands without its breakdown
                out["models"][model]["top_ops_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def measure_grid(specs: list[PointSpec]) -> Iterator[dict[str, Any]]:
    """Each spec's result in turn (as :func:`measure`'s, or {"error": ...}), every model's
    session made once for the whole grid: a session's first runs at a shape larger than any
    before it fault in its memory (batch 32 x 1024 tokens of the base causal export: 38 s of
    warm-up runs for 4 candidates, 1.2-1.7 s a run after), so a grid timed largest first pays
    that once, not at every point."""
    from mha_onnx.errors import MhaOnnxError

    kept: dict[str, Any] = {}
    try:
        for spec in specs:
            try:
                yield measure(spec, kept)
            except MhaOnnxError as exc:
                yield {"error": str(exc)}
    finally:
        for runner in kept.values():
            runner.close()


def _op_times(spec: PointSpec, model: str) -> dict[str, Any]:
    """The top ops of ``model`` by time (and the provider that ran each) from two profiled
    runs; control flow nodes are left out since their time is their subgraphs' nodes,
    listed too."""
    from mha_onnx.profile.flops import trace_flops
    from mha_onnx.runtime.ort import read_profile

    folder = spec.trace_dir or None
    with tempfile.TemporaryDirectory(prefix="mha_onnx_prof_") as tmp:
        runner = _runner(spec, model, profile_dir=folder or tmp)
        feeds = _feeds(spec, target(model))
        runner.infer(feeds)
        runner.infer(feeds)
        trace = runner.end_profiling()
        runner.close()
        events = read_profile(trace) if trace else []
        work = trace_flops(json.loads(Path(trace).read_text()), runs=2) if trace else None
    totals: dict[tuple[str, str], float] = {}
    for event in events:
        if event.op_type not in CONTROL_FLOW:
            key = (event.op_type, event.provider)
            totals[key] = totals.get(key, 0.0) + event.micros
    whole = sum(totals.values()) or 1.0
    top = [{"op_type": k[0], "provider": k[1], "micros": v / 2, "share": v / whole}
           for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:8]]
    return {"top_ops": top, "trace": trace if folder else None, "graph_flops": work}


def in_child(payload: dict[str, Any] | PointSpec) -> dict[str, Any]:
    """Run ``python -m mha_onnx.profile`` on ``payload`` (a point spec, or a roofline
    request); a failure or a crash comes back as {"error": what happened}."""
    if isinstance(payload, PointSpec):
        payload = {"point": asdict(payload)}
    done = subprocess.run([sys.executable, "-m", "mha_onnx.profile"], input=json.dumps(payload),
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return {"error": f"onnxruntime crashed ({name}) in the measuring process"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["child process failed"])[-1]
        return {"error": tail[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def grid_in_child(specs: list[PointSpec], on_result: Callable[[int, dict[str, Any]], None]
                  ) -> None:
    """Time ``specs`` in one child process (:func:`measure_grid`), ``on_result(index,
    result)`` as each point ends. A crash ends that child: the point it was timing comes
    back as the error, and the rest are timed each in a child of its own."""
    done = set()
    # (stderr to a file: a child writing more warnings than a pipe holds would block while
    # this process reads its stdout)
    with tempfile.TemporaryFile("w+") as errors, subprocess.Popen(
            [sys.executable, "-m", "mha_onnx.profile"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=errors, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"}) as child:
        child.stdin.write(json.dumps({"points": [asdict(s) for s in specs]}))
        child.stdin.close()
        for line in child.stdout:
            if line.startswith("{"):
                result = json.loads(line)
                done.add(result["index"])
                on_result(result["index"], result["result"])
        child.wait()
        errors.seek(0)
        stderr = errors.read()
    if len(done) == len(specs):
        return
    rest = [n for n in range(len(specs)) if n not in done]
    code = child.returncode
    why = (f"onnxruntime crashed ({signal.Signals(-code).name}) in the measuring process"
           if code < 0 else (stderr.strip().splitlines() or ["child process failed"])[-1][:300])
    on_result(rest[0], {"error": why})
    for n in rest[1:]:
        on_result(n, in_child(specs[n]))
