"""What a decode step costs as the batch grows: the serving engine's rows (mha_onnx.serve.rows)
of one decoder, each joined with a prompt of ``--prompt`` tokens, then timed over steps of
every row, batch after batch in one process.

    .venv/bin/python -m tools.bench_rows MODEL [--batches 1,2,4,8,16] [--prompt 128]
        [--steps 30] [--threads 2]

Prints, per batch: the step's median time, the time per row, and the tokens per second of
the steps alone (no prompt work: the ceiling continuous batching approaches when prompts are
short next to the outputs).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from mha_onnx.generate.loop import Generator
    from mha_onnx.serve.rows import AppendedRows, SharedRows

    generator = Generator(args.model, threads=args.threads)
    rng = np.random.default_rng(0)
    print(f"`python -m tools.bench_rows {' '.join(sys.argv[1:] if argv is None else argv)}`\n")
    print("| rows | step ms (median) | ms per row | tokens/s of the steps |\n|---|---|---|---|")
    base = None
    for batch in (int(b) for b in args.batches.split(",")):
        rows = SharedRows(generator, batch, args.prompt + args.steps + 8) \
            if generator.interface.shared else AppendedRows(generator, batch)
        step = timed_steps(rows, args.prompt, args.steps, rng)
        base = base or step
        print(f"| {batch} | {1e3 * step:.2f} | {1e3 * step / batch:.2f} | {batch / step:.0f} "
              f"({batch * base / step:.2f}x of one row) |")
    generator.close()
    return 0


def timed_steps(rows, prompt: int, steps: int, rng, session=None) -> float:
    """The median seconds of a greedy step of every slot of ``rows`` (serve/rows.py), each
    joined first with ``prompt`` random tokens, over ``steps`` steps (the first 3 not
    counted); ``session``: the one the steps run through, if not the joins'."""
    vocab = rows.iface.vocab
    tokens = np.array([int(rows.join(r, [int(t) for t in rng.integers(3, vocab, prompt)])
                           .argmax()) for r in range(rows.slots)])
    if session is not None:
        rows.session = session
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        tokens = rows.step(tokens).argmax(-1)
        times.append(time.perf_counter() - started)
    return float(np.median(times[3:]))


if __name__ == "__main__":
    sys.exit(main())
