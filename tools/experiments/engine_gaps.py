"""The continuous-batching engine alone (no HTTP) under decode-heavy load: output tokens/s
and the gaps between two tokens of one stream, with a prompt's chunks run with the step
(``--mixed-steps``, the default) or apart.

    .venv/bin/python -m tools.experiments.engine_gaps MODEL [--chunk 16] [--apart]
        [--requests 32] [--rows 16] [--threads 2]

MODEL: a shared-cache decoder. ``--requests`` requests (prompts of 32-128 random tokens,
128-256 new ones, seed 0, no EOS) are submitted at once to an engine of ``--rows`` rows
and 1,400 positions; each stream's gaps are timed as its tokens arrive. Prints tokens/s,
the gaps' p50/p90/p99, and the median time of each kind of turn (a step alone, a chunk
alone, a chunk with the step).
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--apart", action="store_true", help="--no-mixed-steps")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from mha_onnx.serve import Engine, EngineConfig, Request

    rng = np.random.default_rng(0)
    requests = [(tuple(int(t) for t in rng.integers(3, 500, int(n))), int(m))
                for n, m in zip(rng.integers(32, 129, args.requests),
                                rng.integers(128, 257, args.requests), strict=True)]
    turns: dict[str, list[float]] = {"step": [], "chunk": [], "mixed": []}
    config = EngineConfig(max_batch=args.rows, prefill_chunk=args.chunk, max_length=1400,
                          max_queue=args.requests,
                          threads=args.threads, mixed_steps=not args.apart)
    with Engine(args.model, config) as engine:
        for kind, name in (("step", "_step"), ("chunk", "_prefill"), ("mixed", "_mixed")):
            setattr(engine, name, _timed(getattr(engine, name), turns[kind]))
        gaps: list[float] = []
        start = time.perf_counter()
        handles = [engine.submit(Request(prompt, new, eos=())) for prompt, new in requests]
        watchers = [threading.Thread(target=_watch, args=(h, gaps)) for h in handles]
        for w in watchers:
            w.start()
        for w in watchers:
            w.join()
        wall = time.perf_counter() - start
        mixing = engine.rows.mixer is not None
    ms = 1000 * np.array(gaps)
    print(f"{args.model}: --prefill-chunk {args.chunk}, mixed {mixing}: "
          f"{sum(n for _, n in requests) / wall:.1f} tokens/s, gaps p50/p90/p99 "
          + " / ".join(f"{v:.1f}" for v in np.percentile(ms, [50, 90, 99])) + " ms")
    print("turns (median ms): " + ", ".join(
        f"{kind} {1000 * np.median(t):.1f} x{len(t)}" for kind, t in turns.items() if t))
    return 0


def _timed(run, into: list[float]):
    def timed(*a):
        start = time.perf_counter()
        run(*a)
        into.append(time.perf_counter() - start)
    return timed


def _watch(handle, gaps: list[float]) -> None:
    last = None
    for _ in handle:
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now


if __name__ == "__main__":
    raise SystemExit(main())
