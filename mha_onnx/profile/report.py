"""What ``profile`` is asked (:class:`ProfileConfig`) and what it answers
(:class:`ProfileReport` of :class:`Point`), rendered as a table or as JSON (with a schema
version, so reports from several machines can be merged)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mha_onnx.errors import ConfigError
from mha_onnx.runtime import capabilities
from mha_onnx.table import human_bytes, table

SCHEMA_VERSION = 2
DEFAULT_ITERS, DEFAULT_MIN_TIME = 10, 0.3


@dataclass(frozen=True)
class ProfileConfig:
    """``iters`` and ``min_time``: each point runs at least that many times and at least that
    long (defaults 10 runs and 0.3 s, after ``warmup`` runs). ``threads``: the intra-op
    thread counts to try (None: ONNX Runtime's default, one per core). ``interleave``: the
    models of one point run in turn in one process (fair ratios on a noisy machine; no
    memory figures then)."""

    providers: tuple[str, ...] = ("cpu",)
    batches: tuple[int, ...] = (1,)
    seq_lens: tuple[int, ...] = (128, 512, 2048)
    warmup: int = 3
    iters: int | None = DEFAULT_ITERS
    min_time: float | None = DEFAULT_MIN_TIME
    threads: tuple[int | None, ...] = (None,)
    io_binding: bool = False
    trace_dir: str | None = None
    pad_fraction: float = 0.0
    op_breakdown: bool = True
    memory_check: bool = True
    interleave: bool = False
    inputs: str | None = None
    decode: bool = False  # seq_lens are cache lengths: one new token per step
    keep_going: bool = False  # finish the sweep after a failed point (default: stop there)

    def __post_init__(self) -> None:
        if isinstance(self.threads, int) or self.threads is None:
            object.__setattr__(self, "threads", (self.threads,))
        if not self.seq_lens or any(n < 1 for n in self.seq_lens):
            raise ConfigError("--seq-lens must be positive integers")
        if not self.batches or any(n < 1 for n in self.batches):
            raise ConfigError("--batch must be positive integers")
        if not self.threads or any(t is not None and t < 1 for t in self.threads):
            raise ConfigError("--threads must be positive integers")
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
    threads: int = 0  # the intra-op threads used (ORT's default resolved to the core count)
    iters: int = 0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    min_ms: float = 0.0
    tokens_per_s: float | None = 0.0  # None: the model has no length axis (a fixed image)
    gflop: float | None = None
    gflops: float | None = None
    roofline_fraction: float | None = None
    peak_rss_bytes: int | None = None
    run_rss_bytes: int | None = None
    device_bytes: int | None = None
    cache_bytes: int | None = None  # decode: the KV cache one step reads
    weight_bytes: int | None = None  # decode: the weights one step reads (all of them)
    bandwidth_fraction: float | None = None  # decode: cache bytes / time over the bandwidth
    session_s: float = 0.0
    top_ops: tuple[OpTime, ...] = ()
    trace: str | None = None
    error: str | None = None

    @property
    def memory(self) -> int | None:
        """The peak: the device's memory in use on a GPU, else the worker's peak resident
        set (the weights, the sessions and the runs: what the host must have free)."""
        return self.device_bytes if self.device_bytes is not None else self.peak_rss_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["top_ops"] = [asdict(o) for o in self.top_ops]
        if self.error is not None:  # a failed point has no figures, not zeros
            for key in ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "min_ms", "tokens_per_s",
                        "iters", "session_s"):
                data[key] = None
        for key in ("roofline_fraction", "bandwidth_fraction"):
            if data[key] is not None and data[key] > 1.0:
                data[key + "_note"] = ("above 1: the probe measured less than this run "
                                       "achieved, so it bounds nothing here")
        return data


@dataclass(frozen=True)
class ProfileReport:
    points: tuple[Point, ...]
    roofline_gflops: dict[str, float]
    machine: dict[str, Any]
    seconds: float
    models: tuple[str, ...] = field(default_factory=tuple)
    interleaved: bool = False
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)  # decode: read GB/s
    decode: bool = False

    def __bool__(self) -> bool:
        return all(p.error is None for p in self.points)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "machine": self.machine,
                "roofline_gflops": self.roofline_gflops, "interleaved": self.interleaved,
                "decode": self.decode, "bandwidth_gbps": self.bandwidth_gbps,
                "points": [p.to_dict() for p in self.points], "speedups": self.speedups(),
                "best_threads": self.best_threads(), "seconds": round(self.seconds, 2)}

    def speedups(self) -> list[dict[str, Any]]:
        """Each model's p50 against the first model's at the same provider/batch/length/threads."""
        if len(self.models) < 2:
            return []
        key = lambda p: (p.provider, p.batch, p.seq_len, p.threads)  # noqa: E731
        base = {key(p): p for p in self.points if p.model == self.models[0] and p.error is None}
        out = []
        for p in self.points:
            ref = base.get(key(p))
            if p.model == self.models[0] or ref is None or p.error is not None or not p.p50_ms:
                continue
            memory = (p.memory / ref.memory) if p.memory and ref.memory else None
            out.append({"model": p.model, "provider": p.provider, "batch": p.batch,
                        "seq_len": p.seq_len, "threads": p.threads,
                        "speedup": ref.p50_ms / p.p50_ms, "memory_ratio": memory})
        return out

    def best_threads(self) -> list[dict[str, Any]]:
        """Per model, provider, batch and length: the thread count with the lowest p50."""
        best: dict[tuple, Point] = {}
        for p in self.points:
            key = (p.model, p.provider, p.batch, p.seq_len)
            if p.error is None and (key not in best or p.p50_ms < best[key].p50_ms):
                best[key] = p
        return [{"model": p.model, "provider": p.provider, "batch": p.batch,
                 "seq_len": p.seq_len, "threads": p.threads, "p50_ms": p.p50_ms}
                for p in best.values()]

    def render(self) -> str:
        label = short_names([*self.models, *(p.model for p in self.points)])
        isa = f", {self.machine['isa']}" if self.machine.get("isa") else ""
        lines = [f"profile on {self.machine.get('processor') or self.machine.get('machine')} "
                 f"({self.machine.get('cpus')} CPUs{isa}), onnxruntime {self.machine.get('onnxruntime')}"
                 + (f", openvino {self.machine['openvino']}" if self.machine.get("openvino")
                    and any(capabilities(p.provider).runtime == "openvino" for p in self.points) else "")
                 + (", models interleaved in one process" if self.interleaved else "")]
        for key, value in self.roofline_gflops.items():
            lines.append(f"  matmul roofline ({key}): {value:.1f} GFLOP/s")
        for key, value in self.bandwidth_gbps.items():
            lines.append(f"  memory bandwidth ({key}): {value:.1f} GB/s (reading)")
        if self.decode:
            lines.append("  decode: one new token per step after 'seq' cached positions; "
                         "'roofline' = time to read the cache and the weights once at that "
                         "bandwidth / p50")
            head = ["model", "ep", "batch", "cache", "threads", "p50 ms", "p90 ms", "p99 ms",
                    "min ms", "tokens/s", "cache MB", "roofline", "peak mem", "load s"]
            lines.append(table(head, [_decode_row(p, label[p.model]) for p in self.points]))
        else:
            lines.append(table(["model", "ep", "batch", "seq", "threads", "p50 ms", "p90 ms",
                                "p99 ms", "min ms", "tokens/s", "GFLOP/s", "roofline", "peak mem",
                                "load s"], [_row(p, label[p.model]) for p in self.points]))
        for s in self.speedups():
            ratio = "" if s["memory_ratio"] is None else f", peak memory x{s['memory_ratio']:.2f}"
            lines.append(f"  {label[s['model']]} vs {label[self.models[0]]} ({s['provider']}, "
                         f"batch {s['batch']}, seq {s['seq_len']}, {s['threads']} threads): "
                         f"{speed_words(s['speedup'])}{ratio}")
        if len({p.threads for p in self.points}) > 1:
            for b in self.best_threads():
                lines.append(f"  best threads {label[b['model']]} {b['provider']} b{b['batch']} "
                             f"s{b['seq_len']}: {b['threads']} ({b['p50_ms']:.2f} ms)")
        failed = [p for p in self.points if p.error]
        for p in failed:
            lines.append(f"  FAILED {label[p.model]} {p.provider} b{p.batch} "
                         f"s{p.seq_len}: {p.error}")
        if any((p.roofline_fraction or 0) > 1 or (p.bandwidth_fraction or 0) > 1
               for p in self.points):
            lines.append("  roofline '>100%?': the probe measured less than the run achieved "
                         "(threads, sizes or caches differ), so it is no bound there")
        for p in self.points:
            if p.top_ops:
                ops = ", ".join(f"{o.op_type}@{o.provider} {100 * o.share:.0f}%" for o in p.top_ops[:4])
                lines.append(f"  top ops {label[p.model]} {p.provider} b{p.batch} s{p.seq_len}: {ops}")
        return "\n".join(lines)


def speed_words(speedup: float) -> str:
    """``1.16x faster`` / ``1.16x slower`` (never ``x0.86 faster``)."""
    if speedup >= 1:
        return f"{speedup:.2f}x faster"
    return f"{1 / speedup:.2f}x slower"


def _fraction(value: float | None) -> str:
    """A roofline share; above 100 % the probe bounds nothing and is flagged, not printed."""
    if value is None:
        return "-"
    return ">100%?" if value > 1.0 else f"{100 * value:.0f}%"


def short_names(paths) -> dict[str, str]:
    """Each path by its file name, or by as many of its last parts as tell it apart from the
    others (``genai/model.onnx`` and ``fused/model.onnx``, not ``model.onnx`` twice)."""
    paths = list(dict.fromkeys(str(p) for p in paths))
    out = {}
    for path in paths:
        parts = Path(path).parts
        for n in range(1, len(parts) + 1):
            tail = Path(*parts[-n:])
            if all(Path(*Path(o).parts[-n:]) != tail for o in paths if o != path):
                break
        out[path] = str(tail)
    return out


def _row(p: Point, name: str) -> tuple:
    return _cells(p, name, "-" if p.gflops is None else f"{p.gflops:.1f}", _fraction(p.roofline_fraction))


def _decode_row(p: Point, name: str) -> tuple:
    return _cells(p, name, "-" if p.cache_bytes is None else f"{p.cache_bytes / 1e6:.1f}",
                  _fraction(p.bandwidth_fraction))


def _cells(p: Point, name: str, work: str, roofline: str) -> tuple:
    """One table row: the point, its latencies, then ``work`` and ``roofline`` (GFLOP/s and
    % of the matmul roofline, or cache MB and % of the bandwidth roofline)."""
    head = (name, p.provider, p.batch, p.seq_len or "-", p.threads)
    if p.error:
        return head + ("ERROR", "(below)") + ("",) * 7
    memory = "-" if p.memory is None else human_bytes(p.memory)
    tokens = "-" if p.tokens_per_s is None else f"{p.tokens_per_s:,.0f}"
    return head + (p.p50_ms, p.p90_ms, p.p99_ms, p.min_ms, tokens, work,
                   roofline, memory, f"{p.session_s:.2f}")
