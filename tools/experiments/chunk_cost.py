"""What one prompt chunk costs the serving engine, alone in its slot, without and after a past:
the run `--prefill-chunk` puts between two decode steps, so the longest gap a running stream
sees while a request joins.

    .venv/bin/python -m tools.experiments.chunk_cost MODEL [--chunks 16,64]
        [--pasts 16,128,512] [--max-length 1400] [--repeats 5] [--threads 2]

MODEL: a shared-cache decoder (``fuse --kv-cache shared``, quantized or not). Each figure is
the median over ``--repeats`` runs of one chunk of that many tokens at batch 1
(mha_onnx.serve.rows.SharedRows, as the engine runs it): a first chunk (no past: the prompt
form) and a chunk after ``past`` cached positions of the same row (the rows form's branch
for one row: GroupQueryAttention after the row's kept keys; files fused before it had that
branch run the exact general form there, whose cost grows with ``--max-length``).
``--max-length``: the cache buffers' positions (tools/bench_serve's servers: 1400).
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--chunks", default="16,64")
    p.add_argument("--pasts", default="16,128,512")
    p.add_argument("--max-length", type=int, default=1400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from mha_onnx.generate.loop import Generator
    from mha_onnx.serve.rows import SharedRows

    chunks = [int(c) for c in args.chunks.split(",")]
    pasts = [int(c) for c in args.pasts.split(",")]
    generator = Generator(args.model, threads=args.threads)
    longest = max(pasts) + max(chunks)
    if longest > args.max_length:
        p.error(f"a past of {max(pasts)} and a chunk of {max(chunks)} pass --max-length")
    rows = SharedRows(generator, 2, args.max_length)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 500, longest)]
    ids = itertools.count()

    def chunk_ms(past: int, n: int) -> float:
        """One chunk of ``n`` after ``past`` positions of a fresh row (ms)."""
        row = next(ids)
        if past:
            rows.prefill(row, prompt[:past + n], past)
        start = time.perf_counter()
        rows.prefill(row, prompt[:past + n], past + n)
        spent = time.perf_counter() - start
        rows.leave(row)
        return 1000 * spent

    print("| chunk | past | ms (median) | vs the first chunk |")
    print("|---|---|---|---|")
    for n in chunks:
        first = float(np.median([chunk_ms(0, n) for _ in range(args.repeats)]))
        print(f"| {n} | 0 | {first:.1f} | 1.00x |")
        for past in pasts:
            after = float(np.median([chunk_ms(past, n) for _ in range(args.repeats)]))
            print(f"| {n} | {past} | {after:.1f} | {after / first:.2f}x |")
    generator.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
