"""``profile``: latency percentiles, throughput, achieved GFLOP/s against a measured matmul
roofline, peak memory and per-op time, per model x provider x batch x sequence length.

Each point runs in a child process (``python -m mha_onnx.profile``) so that its peak RSS is
its own; CUDA points read device memory through NVML when it is available.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.config import MhaConfig
from mha_onnx.errors import ConfigError, MhaOnnxError
from mha_onnx.inputs import case_for, ensure_fits, input_specs, make_inputs
from mha_onnx.metadata import config_of
from mha_onnx.table import human_bytes, table

log = logging.getLogger(__name__)


CONTROL_FLOW = ("Loop", "If", "Scan")
DEFAULT_ITERS, DEFAULT_MIN_TIME = 10, 0.3


@dataclass(frozen=True)
class ProfileConfig:
    """``iters`` and ``min_time``: each point runs at least that many times and at least that
    long (defaults 10 runs and 0.3 s, after ``warmup`` runs)."""

    providers: tuple[str, ...] = ("cpu",)
    batches: tuple[int, ...] = (1,)
    seq_lens: tuple[int, ...] = (128, 512, 2048)
    warmup: int = 3
    iters: int | None = DEFAULT_ITERS
    min_time: float | None = DEFAULT_MIN_TIME
    threads: int | None = None
    io_binding: bool = False
    trace_dir: str | None = None
    pad_fraction: float = 0.0
    op_breakdown: bool = True
    memory_check: bool = True

    def __post_init__(self) -> None:
        if not self.seq_lens or any(n < 1 for n in self.seq_lens):
            raise ConfigError("--seq-lens must be positive integers")
        if not self.batches or any(n < 1 for n in self.batches):
            raise ConfigError("--batch must be positive integers")
        if self.warmup < 0 or (self.iters is not None and self.iters < 1):
            raise ConfigError("--warmup must be >= 0 and --iters >= 1")
        if self.min_time is not None and self.min_time <= 0:
            raise ConfigError("--min-time must be positive")
        if not 0.0 <= self.pad_fraction < 1.0:
            raise ConfigError("--pad-fraction must be in [0, 1)")


@dataclass(frozen=True)
class OpTime:
    op_type: str
    provider: str
    micros: float
    share: float


@dataclass(frozen=True)
class Point:
    model: str
    provider: str
    batch: int
    seq_len: int
    iters: int = 0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    min_ms: float = 0.0
    tokens_per_s: float = 0.0
    gflop: float | None = None
    gflops: float | None = None
    roofline_fraction: float | None = None
    peak_rss_bytes: int = 0
    run_rss_bytes: int = 0
    device_bytes: int | None = None
    session_s: float = 0.0
    top_ops: tuple[OpTime, ...] = ()
    trace: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["top_ops"] = [asdict(o) for o in self.top_ops]
        return data


@dataclass(frozen=True)
class ProfileReport:
    points: tuple[Point, ...]
    roofline_gflops: dict[str, float]
    machine: dict[str, Any]
    seconds: float
    models: tuple[str, ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return all(p.error is None for p in self.points)

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "roofline_gflops": self.roofline_gflops,
                "points": [p.to_dict() for p in self.points], "speedups": self.speedups(),
                "seconds": round(self.seconds, 2)}

    def speedups(self) -> list[dict[str, Any]]:
        """Each model's p50 against the first model's at the same provider/batch/length."""
        if len(self.models) < 2:
            return []
        base = {(p.provider, p.batch, p.seq_len): p for p in self.points
                if p.model == self.models[0] and p.error is None}
        out = []
        for p in self.points:
            ref = base.get((p.provider, p.batch, p.seq_len))
            if p.model == self.models[0] or ref is None or p.error is not None or not p.p50_ms:
                continue
            out.append({"model": p.model, "provider": p.provider, "batch": p.batch,
                        "seq_len": p.seq_len, "speedup": ref.p50_ms / p.p50_ms,
                        "memory_ratio": (p.run_rss_bytes / ref.run_rss_bytes
                                         if ref.run_rss_bytes else None)})
        return out

    def render(self) -> str:
        lines = [f"profile on {self.machine.get('processor') or self.machine.get('machine')}, "
                 f"onnxruntime {self.machine.get('onnxruntime')}, threads "
                 f"{self.machine.get('threads') or 'default'}"]
        for key, value in self.roofline_gflops.items():
            lines.append(f"  matmul roofline ({key}): {value:.1f} GFLOP/s")
        rows = []
        for p in self.points:
            if p.error:
                rows.append((Path(p.model).name, p.provider, p.batch, p.seq_len, "ERROR", p.error[:60],
                             "", "", "", "", "", "", ""))
                continue
            mem = human_bytes(p.device_bytes) if p.device_bytes is not None else human_bytes(p.run_rss_bytes)
            rows.append((Path(p.model).name, p.provider, p.batch, p.seq_len, p.p50_ms, p.p90_ms,
                         p.p99_ms, p.min_ms, f"{p.tokens_per_s:,.0f}",
                         "-" if p.gflops is None else f"{p.gflops:.1f}",
                         "-" if p.roofline_fraction is None else f"{100 * p.roofline_fraction:.0f}%",
                         mem, f"{p.session_s:.2f}"))
        lines.append(table(["model", "ep", "batch", "seq", "p50 ms", "p90 ms", "p99 ms", "min ms",
                            "tokens/s", "GFLOP/s", "roofline", "memory", "load s"], rows))
        for s in self.speedups():
            ratio = "" if s["memory_ratio"] is None else f", memory x{s['memory_ratio']:.2f}"
            lines.append(f"  {Path(s['model']).name} vs {Path(self.models[0]).name} "
                         f"({s['provider']}, batch {s['batch']}, seq {s['seq_len']}): "
                         f"x{s['speedup']:.2f} faster{ratio}")
        for p in self.points:
            if p.top_ops:
                ops = ", ".join(f"{o.op_type}@{o.provider} {100 * o.share:.0f}%" for o in p.top_ops[:4])
                lines.append(f"  top ops {Path(p.model).name} {p.provider} b{p.batch} s{p.seq_len}: {ops}")
        return "\n".join(lines)

    def write_csv(self, path: str | Path) -> None:
        from mha_onnx.graphio import atomic_path

        fields = [f for f in Point.__dataclass_fields__ if f not in ("top_ops",)]
        with atomic_path(path, force=True) as tmp, tmp.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            for p in self.points:
                row = p.to_dict()
                row.pop("top_ops")
                writer.writerow(row)


# -- FLOPs and memory estimates --------------------------------------------------------------

def attention_flops(cfg: MhaConfig, batch: int, seq_q: int, seq_kv: int, kept: int | None = None) -> float:
    """Multiply-adds x 2 of one attention layer: the four projections, Q K^T and A V over the
    (query, key) pairs that are attended (causal: i >= j only; padded keys excluded)."""
    kept = seq_kv if kept is None else kept
    d, h = cfg.d_model, cfg.num_heads
    proj = 2 * batch * (seq_q * d * cfg.qk_dim + seq_kv * d * cfg.qk_dim + seq_kv * d * cfg.v_dim
                        + seq_q * cfg.v_dim * d)
    if cfg.mask == "causal":
        pairs = sum(min(i + 1, seq_kv) for i in range(seq_q))
    else:
        pairs = seq_q * kept
    core = 2 * batch * h * pairs * (cfg.d_k + cfg.d_v)
    return float(proj + core)


def _config_of(path: str) -> MhaConfig | None:
    import onnx

    return config_of(onnx.load(path, load_external_data=False))


def check_memory(paths: Sequence[str], config: ProfileConfig) -> None:
    """Refuse points whose estimated working set exceeds the memory available now."""
    if not config.memory_check or "cpu" not in config.providers:
        return
    from mha_onnx.graphio import read_model

    for path in paths:
        model = read_model(path)
        specs = input_specs(model)
        cases = [case_for(specs, Path(path).name, b, [s])
                 for b in config.batches for s in config.seq_lens]
        ensure_fits(model, cases, hint="lower --seq-lens/--batch, fuse the model, or pass "
                                       "--no-memory-check")


def _feeds_for(path: str, batch: int, seq: int, pad_fraction: float, seed: int = 0) -> dict[str, np.ndarray]:
    from mha_onnx.graphio import read_model

    specs = input_specs(read_model(path, load_external_data=False))
    padding = "tail" if pad_fraction else "none"
    return make_inputs(specs, case_for(specs, "profile", batch, [seq], padding, pad_fraction),
                       seed=seed)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0), so that the peak read after the
    runs is theirs, not that of start-up (imports, session creation)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """VmHWM of this process (since the last reset), or ru_maxrss where /proc has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _device_used() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # noqa: BLE001 - NVML is optional
        return None


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """Time one model x provider x batch x seq point (in this process)."""
    from mha_onnx.runtimes import OrtRunner, import_ort, read_profile

    feeds = _feeds_for(spec["model"], spec["batch"], spec["seq_len"], spec["pad_fraction"])
    device0 = _device_used() if spec["provider"] != "cpu" else None
    start = time.perf_counter()
    runner = OrtRunner(spec["model"], spec["provider"], threads=spec["threads"],
                       io_binding=spec["io_binding"], strict=False)
    runner.session  # noqa: B018
    session_s = time.perf_counter() - start
    run = runner.infer
    if runner.io_binding:  # inputs live on the device; only outputs are copied back
        ort = import_ort(for_gpu=True)
        binding = runner.session.io_binding()
        for name, array in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
        for name in runner.output_names:
            binding.bind_output(name, "cuda", 0)

        def run(_feeds):  # noqa: ANN001
            runner.session.run_with_iobinding(binding)
    rss_before = _rss()
    _reset_peak_rss()
    for _ in range(spec["warmup"]):
        run(feeds)
    times = []
    deadline = time.perf_counter() + (spec["min_time"] or 0.0)
    target = spec["iters"] if spec["iters"] else (3 if spec["min_time"] else 10)
    while len(times) < target or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - t0)
        if len(times) >= 100_000:
            break
    peak = _peak_rss()
    device = _device_used()
    result: dict[str, Any] = {
        "times": times, "session_s": session_s, "peak_rss": peak,
        "run_rss": max(0, peak - rss_before),
        "device_bytes": None if device0 is None or device is None else max(0, device - device0),
    }
    runner.close()
    if spec["op_breakdown"] or spec["trace_dir"]:
        folder = spec["trace_dir"] or None
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mha_onnx_prof_") as tmp:
            prof = OrtRunner(spec["model"], spec["provider"], threads=spec["threads"],
                             io_binding=spec["io_binding"], strict=False,
                             profile_dir=folder or tmp)
            prof.infer(feeds)
            prof.infer(feeds)
            trace = prof.end_profiling()
            prof.close()
            events = read_profile(trace) if trace else []
            result["trace"] = trace if folder else None
        totals: dict[tuple[str, str], float] = {}
        for event in events:
            if event.op_type in CONTROL_FLOW:  # their time is their subgraphs' nodes, listed too
                continue
            key = (event.op_type, event.provider)
            totals[key] = totals.get(key, 0.0) + event.micros
        whole = sum(totals.values()) or 1.0
        result["top_ops"] = [
            {"op_type": k[0], "provider": k[1], "micros": v / 2, "share": v / whole}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:8]
        ]
    return result


def matmul_roofline(provider: str, threads: int | None, dtype: str = "float32") -> float:
    """GFLOP/s of large square MatMuls on ``provider`` (best of several runs and sizes): the
    machine's practical ceiling for the attention's matrix products."""
    from onnx import TensorProto, helper

    from mha_onnx.runtimes import OrtRunner

    sizes = (1024, 2048) if provider == "cpu" else (4096, 8192)
    elem = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    np_dtype = np.float16 if dtype == "float16" else np.float32
    rng = np.random.default_rng(0)
    best = 0.0
    for n in sizes:
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["a", "b"], ["c"])], "roofline",
            [helper.make_tensor_value_info("a", elem, [n, n]),
             helper.make_tensor_value_info("b", elem, [n, n])],
            [helper.make_tensor_value_info("c", elem, [n, n])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        feeds = {"a": rng.standard_normal((n, n)).astype(np_dtype),
                 "b": rng.standard_normal((n, n)).astype(np_dtype)}
        with OrtRunner(model.SerializeToString(), provider, threads=threads,
                       io_binding=provider != "cpu") as runner:
            runner.infer(feeds)
            seconds = min(_timed(runner, feeds) for _ in range(5))
        best = max(best, 2.0 * n**3 / seconds / 1e9)
    return best


def _timed(runner: Any, feeds: dict[str, np.ndarray]) -> float:
    start = time.perf_counter()
    runner.infer(feeds)
    return time.perf_counter() - start


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "mha_onnx.profile"], input=json.dumps(spec), capture_output=True,
        text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["child process failed"])[-1]
        return {"error": tail[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def profile_models(
    paths: Sequence[str | Path],
    config: ProfileConfig,
    on_point: Callable[[int, int, str], None] | None = None,
) -> ProfileReport:
    """Profile every model x provider x batch x length of ``config``."""
    import onnxruntime as ort

    from mha_onnx.graphio import check_readable, read_model
    from mha_onnx.runtimes import OrtRunner

    started = time.perf_counter()
    paths = [str(check_readable(p)) for p in paths]
    for path in paths:
        read_model(path, load_external_data=False)  # refuse non-models before any timing
    check_memory(paths, config)
    providers = []
    for provider in config.providers:  # a provider that cannot run is an error, not a CPU run
        OrtRunner(paths[0], provider, strict=False).session  # noqa: B018
        providers.append(provider)
    if config.trace_dir:
        Path(config.trace_dir).mkdir(parents=True, exist_ok=True)
    roofline = {}
    dtypes = {(_config_of(p) or MhaConfig()).dtype for p in paths}
    for provider in providers:
        for dtype in sorted(dtypes):
            roofline[f"{provider} {dtype}"] = _child({"roofline": True, "provider": provider,
                                                      "threads": config.threads, "dtype": dtype}
                                                     ).get("gflops", 0.0)
    points = []
    total = len(paths) * len(providers) * len(config.batches) * len(config.seq_lens)
    for path in paths:
        cfg = _config_of(path)
        for provider in providers:
            for batch in config.batches:
                for seq in config.seq_lens:
                    label = f"{Path(path).name} {provider} b{batch} s{seq}"
                    if on_point:
                        on_point(len(points), total, label)
                    spec = {"model": path, "provider": provider, "batch": batch, "seq_len": seq,
                            "warmup": config.warmup, "iters": config.iters,
                            "min_time": config.min_time, "threads": config.threads,
                            "io_binding": config.io_binding and provider != "cpu",
                            "pad_fraction": config.pad_fraction,
                            "op_breakdown": config.op_breakdown, "trace_dir": config.trace_dir}
                    raw = _child(spec)
                    points.append(_point(path, provider, batch, seq, raw, cfg, config, roofline))
    if on_point:
        on_point(total, total, "done")
    machine = {"machine": platform.machine(), "processor": _cpu_name(),
               "cpus": os.cpu_count(), "threads": config.threads,
               "onnxruntime": ort.__version__, "python": platform.python_version()}
    return ProfileReport(tuple(points), roofline, machine, time.perf_counter() - started,
                         tuple(paths))


def _point(path: str, provider: str, batch: int, seq: int, raw: dict[str, Any],
           cfg: MhaConfig | None, config: ProfileConfig, roofline: dict[str, float]) -> Point:
    if "error" in raw:
        return Point(path, provider, batch, seq, error=raw["error"])
    ms = np.array(raw["times"]) * 1e3
    p50 = float(np.percentile(ms, 50))
    gflop = gflops = fraction = None
    if cfg is not None:
        kept = seq - int(round(seq * config.pad_fraction)) if cfg.mask == "key-padding" else seq
        gflop = attention_flops(cfg, batch, seq, seq, kept) / 1e9
        gflops = gflop / (p50 / 1e3)
        ceiling = roofline.get(f"{provider} {cfg.dtype}")
        fraction = gflops / ceiling if ceiling else None
    tops = tuple(OpTime(**o) for o in raw.get("top_ops", []))
    return Point(
        model=path, provider=provider, batch=batch, seq_len=seq, iters=len(ms),
        p50_ms=p50, p90_ms=float(np.percentile(ms, 90)), p99_ms=float(np.percentile(ms, 99)),
        mean_ms=float(ms.mean()), min_ms=float(ms.min()), tokens_per_s=batch * seq / (p50 / 1e3),
        gflop=gflop, gflops=gflops, roofline_fraction=fraction,
        peak_rss_bytes=int(raw["peak_rss"]), run_rss_bytes=int(raw["run_rss"]),
        device_bytes=raw.get("device_bytes"), session_s=float(raw["session_s"]),
        top_ops=tops, trace=raw.get("trace"),
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def plot(report: ProfileReport, path: str | Path) -> None:
    """Latency and memory vs sequence length (log-log), one line per model x provider x batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mha_onnx.graphio import atomic_path

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[tuple[str, str, int], list[Point]] = {}
    for p in report.points:
        if p.error is None:
            series.setdefault((Path(p.model).stem, p.provider, p.batch), []).append(p)
    for (model, provider, batch), pts in series.items():
        pts.sort(key=lambda p: p.seq_len)
        label = f"{model} {provider} b{batch}"
        x = [p.seq_len for p in pts]
        ax_t.plot(x, [p.p50_ms for p in pts], marker="o", label=label)
        mem = [(p.device_bytes if p.device_bytes is not None else p.run_rss_bytes) / 2**20 for p in pts]
        ax_m.plot(x, [max(m, 1e-3) for m in mem], marker="o", label=label)
    for ax, ylabel in ((ax_t, "p50 latency (ms)"), (ax_m, "peak working memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.suptitle(f"mha-onnx profile ({report.machine.get('processor')})", fontsize=9)
    fig.tight_layout()
    with atomic_path(path, force=True) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _main() -> None:
    spec = json.loads(sys.stdin.read())
    try:
        if spec.get("roofline"):
            out = {"gflops": matmul_roofline(spec["provider"], spec["threads"], spec["dtype"])}
        else:
            out = run_point(spec)
    except MhaOnnxError as exc:
        print(str(exc), file=sys.stderr)
        sys.exit(2)
    print(json.dumps(out))


if __name__ == "__main__":
    _main()
