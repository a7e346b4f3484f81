"""``profile_models``: every model x provider x batch x length x thread count, each point in
a child process of its own (or, interleaved, all models of a point in one), turned into a
:class:`~mha_onnx.profile.report.ProfileReport`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.graph.files import check_readable, read_model
from mha_onnx.graph.inputs import case_for, input_specs
from mha_onnx.graph.metadata import config_of
from mha_onnx.profile.flops import attention_flops
from mha_onnx.profile.memory import ensure_fits
from mha_onnx.profile.report import OpTime, Point, ProfileConfig, ProfileReport
from mha_onnx.profile.worker import PointSpec, in_child
from mha_onnx.runtime.machine import machine_info


def check_memory(paths: Sequence[str], config: ProfileConfig) -> None:
    """Refuse points whose estimated working set exceeds the memory available now."""
    if not config.memory_check or "cpu" not in config.providers or config.decode:
        return
    for path in paths:
        model = read_model(path)
        specs = input_specs(model)
        cases = [case_for(specs, Path(path).name, b, [s])
                 for b in config.batches for s in config.seq_lens]
        ensure_fits(model, cases, hint="lower --seq-lens/--batch, fuse the model, or pass "
                                       "--no-memory-check")


def resolved_threads(threads: int | None) -> int:
    """The intra-op threads ORT uses: as given, or its default (one per physical core)."""
    if threads:
        return threads
    import os

    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def _check_sessions(paths: Sequence[str], config: ProfileConfig) -> None:
    """Each model on each provider: a crash (seen in a child process) is refused with what
    still works; a provider that cannot run is an error, never a CPU run."""
    from mha_onnx.errors import RuntimeCrash
    from mha_onnx.graph.metadata import session_options
    from mha_onnx.graph.preflight import preflight
    from mha_onnx.runtime import capabilities, make_runner

    for provider in config.providers:
        for path in paths if capabilities(provider).child_preflight else ():  # ORT meets them in a child
            level = session_options(read_model(path, load_external_data=False)).get(
                "optimization", "all")
            checked = preflight(path, provider, level)
            if checked.crashed:
                raise RuntimeCrash(f"{Path(path).name}: {checked.message()}",
                                   hint="fuse the model: the fused file records the session "
                                        "options it needs")
        make_runner(paths[0], provider, strict=False).session  # noqa: B018


def model_dtype(model) -> str:
    """The float type a model computes in: its config's, else its first float output's."""
    cfg = config_of(model)
    if cfg is not None:
        return cfg.dtype
    types = [o.type.tensor_type.elem_type for o in model.graph.output]
    return "float16" if types and types[0] == 10 else "float32"  # (10: FLOAT16)


_CEILINGS: dict[str, float] = {}  # a probe's request (JSON) -> what it measured


def _ceiling(request: dict[str, Any], key: str) -> float:
    """A machine's ceiling (the matmul roofline, the memory bandwidth) for ``request``,
    measured in a child process once per process: a program that profiles model after model
    (tools/, a notebook, the tests) pays the probes' seconds once, not per call. A probe that
    measured nothing is asked again next time."""
    import json

    asked = json.dumps(request, sort_keys=True)
    if asked not in _CEILINGS:
        measured = in_child(request).get(key, 0.0)
        if not measured:
            return 0.0
        _CEILINGS[asked] = measured
    return _CEILINGS[asked]


def _rooflines(paths: Sequence[str], config: ProfileConfig) -> dict[str, float]:
    dtypes = {model_dtype(read_model(p, load_external_data=False)) for p in paths}
    return {f"{provider} {dtype}": _ceiling({"roofline": True, "provider": provider,
                                             "threads": config.threads[-1], "dtype": dtype},
                                            "gflops")
            for provider in config.providers for dtype in sorted(dtypes)}


def profile_models(paths: Sequence[str | Path], config: ProfileConfig,
                   on_point: Callable[[int, int, str], None] | None = None) -> ProfileReport:
    """Profile every model x provider x batch x length x threads of ``config``."""
    started = time.perf_counter()
    paths = [str(check_readable(p)) for p in paths]
    weights: dict[str, int] = {}  # decode: what each step reads besides its cache
    for path in paths:
        model = read_model(path, load_external_data=False)  # refuse non-models before timing
        weights[path] = weight_bytes(model)
        if path == paths[0]:
            batches, seq_lens = model_axes(model, config)
        if config.decode:
            from mha_onnx.profile.feeds import decode_feeds

            decode_feeds(model, 1, 1)  # refuses a model without a cache
    check_memory(paths, config)
    _check_sessions(paths, config)
    if config.trace_dir:
        Path(config.trace_dir).mkdir(parents=True, exist_ok=True)
    roofline = _rooflines(paths, config)
    bandwidth = ({f"{p} float32": _ceiling({"bandwidth": True, "provider": p,
                                            "threads": config.threads[-1]}, "gbps")
                  for p in config.providers} if config.decode else {})
    groups = [tuple(paths)] if config.interleave else [(p,) for p in paths]
    jobs = [(group, provider, batch, seq, threads) for group in groups
            for provider in config.providers for batch in batches
            for seq in seq_lens for threads in config.threads]
    points: list[Point] = []
    for n, (group, provider, batch, seq, threads) in enumerate(jobs):
        if on_point:
            on_point(n, len(jobs), f"{', '.join(Path(p).name for p in group)} {provider} "
                                   f"b{batch} s{seq} t{resolved_threads(threads)}")
        spec = PointSpec(models=group, provider=provider, batch=batch, seq_len=seq,
                         threads=threads, warmup=config.warmup, iters=config.iters,
                         min_time=config.min_time, io_binding=config.io_binding and provider != "cpu",
                         pad_fraction=config.pad_fraction,
                         op_breakdown=config.op_breakdown,
                         trace_dir=config.trace_dir, inputs=config.inputs, decode=config.decode)
        raw = in_child({"point": asdict(spec)})
        points += [_point(model, spec, raw, config, roofline, bandwidth, weights[model])
                   for model in group]
        if any(p.error for p in points[-len(group):]) and not config.keep_going:
            break  # the report says which point failed; --keep-going finishes the sweep
    if on_point:
        on_point(len(jobs), len(jobs), "done")
    return ProfileReport(tuple(points), roofline, machine_info(), time.perf_counter() - started,
                         tuple(paths), config.interleave, bandwidth, config.decode)


def model_axes(model, config: ProfileConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The batches and lengths a sweep can vary on this model: only the axes it has (a ViT
    with a fixed image size has no length: 0 stands for none), and with ``--inputs`` the
    one shape those inputs have."""
    from mha_onnx.graph.inputs import case_of_feeds, input_specs, load_inputs, split_dims

    specs = input_specs(model)
    batch_names, seq_names = split_dims(specs)
    if config.inputs:
        dims = case_of_feeds(specs, load_inputs(config.inputs, specs), "given").dims
        batch = next((dims[n] for n in batch_names if n in dims), 1)
        length = next((dims[n] for n in seq_names if n in dims), 0)
        return (batch,), (length,)
    if not seq_names and not config.decode:
        return config.batches, (0,)
    return config.batches if batch_names else (1,), config.seq_lens


def _point(model: str, spec: PointSpec, raw: dict[str, Any], config: ProfileConfig,
           roofline: dict[str, float], bandwidth: dict[str, float], weights: int) -> Point:
    where = dict(model=model, provider=spec.provider, batch=spec.batch, seq_len=spec.seq_len,
                 threads=resolved_threads(spec.threads))
    if "error" in raw:
        return Point(**where, error=raw["error"])
    mine = raw["models"][model]
    if "error" in mine:
        return Point(**where, error=mine["error"])
    ms = np.array(mine["times"]) * 1e3
    p50 = float(np.percentile(ms, 50))
    measured = dict(
        iters=len(ms), p50_ms=p50, p90_ms=float(np.percentile(ms, 90)),
        p99_ms=float(np.percentile(ms, 99)), mean_ms=float(ms.mean()), min_ms=float(ms.min()),
        peak_rss_bytes=raw.get("peak_rss"), run_rss_bytes=raw.get("run_rss"),
        device_bytes=raw.get("device_bytes"), session_s=float(mine["session_s"]),
        top_ops=tuple(OpTime(**o) for o in mine.get("top_ops", [])), trace=mine.get("trace"))
    rates = (_decode_rates(spec, mine.get("cache_bytes"), p50, bandwidth, weights)
             if config.decode
             else _flop_rates(model, spec, config, roofline, p50, mine.get("graph_flops")))
    return Point(**where, **measured, **rates)


def _flop_rates(model: str, spec: PointSpec, config: ProfileConfig, roofline: dict[str, float],
                p50: float, graph_flops: float | None = None) -> dict[str, Any]:
    """Tokens/s over the whole sequence; GFLOP/s of the layer's exact FLOPs (an mha-onnx
    export), else of the work the graph's matrix kernels did in the profiled runs
    (``graph_flops``: attention counted dense), and its fraction of the matmul roofline."""
    proto = read_model(model, load_external_data=False)
    cfg = config_of(proto)
    gflop = gflops = fraction = None
    if cfg is not None:
        kept = spec.seq_len - int(round(spec.seq_len * config.pad_fraction)) \
            if cfg.mask == "key-padding" else spec.seq_len
        gflop = attention_flops(cfg, spec.batch, spec.seq_len, spec.seq_len, kept) / 1e9
    elif graph_flops:
        gflop = graph_flops / 1e9
    if gflop is not None:
        gflops = gflop / (p50 / 1e3)
        ceiling = roofline.get(f"{spec.provider} {model_dtype(proto)}")
        fraction = gflops / ceiling if ceiling else None
    tokens = spec.batch * spec.seq_len / (p50 / 1e3) if spec.seq_len else None  # none: no length
    return dict(tokens_per_s=tokens, gflop=gflop, gflops=gflops, roofline_fraction=fraction)


def _decode_rates(spec: PointSpec, cache: int | None, p50: float,
                  bandwidth: dict[str, float], weights: int) -> dict[str, Any]:
    """A decode step: tokens/s is one token per batch entry per step; the roofline is
    reading what a step must read once at the measured bandwidth: the model's cache (in
    its own type) and every weight of the model (a decoder's step reads all its weights
    for one token)."""
    gbps = bandwidth.get(f"{spec.provider} float32")
    step = (cache or 0) + weights
    fraction = (step / 1e9 / gbps) / (p50 / 1e3) if step and gbps else None
    return dict(tokens_per_s=spec.batch / (p50 / 1e3), cache_bytes=cache,
                weight_bytes=weights, bandwidth_fraction=fraction)


def weight_bytes(model) -> int:
    """Bytes of the model's initializers, from their dims and element types (external data
    included, nothing loaded)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    return int(sum(np.prod(t.dims, dtype=np.int64) * tensor_dtype_to_np_dtype(t.data_type).itemsize
                   for t in model.graph.initializer))
