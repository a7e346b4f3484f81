"""What a serving engine's step costs through a shared-cache file as written (its run-time
``If``s) against through its decode graph (mha_onnx/generate/decode.py: each ``If``
replaced by its fast branch), for a file whose generator runs one session (no float prompt:
w8a8, float, int4 on a CPU with fast int8), where serve's steps go through the file as
written today.

    .venv/bin/python -m tools.experiments.step_sessions MODEL [--batches 1,16]
        [--prompt 128] [--steps 30] [--rounds 2] [--threads 2]

Each round, for each session and batch: ``batch`` rows of mha_onnx.serve.rows.SharedRows
joined with ``--prompt`` random tokens (through the file as written), then ``--steps``
greedy steps of every row through that session; the median step in ms. Both sessions spin
as the generator's does; the decode graph's session packs the weights once more.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from mha_onnx.generate.decode import decode_graph
    from mha_onnx.generate.loop import Generator
    from mha_onnx.graph.files import read_model
    from mha_onnx.runtime.ort import OrtRunner
    from mha_onnx.serve.rows import SharedRows
    from tools.bench_rows import timed_steps

    generator = Generator(args.model, threads=args.threads)
    if generator.steps_only or not generator.interface.shared:
        raise SystemExit(f"{args.model}: steps already through a decode graph, or no shared "
                         "cache")
    graph = decode_graph(read_model(args.model, load_external_data=False))
    if graph is None:
        raise SystemExit(f"{args.model}: no decode graph")
    decode = OrtRunner(graph.SerializeToString(), "cpu", threads=args.threads,
                       external_data_dir=Path(args.model).parent)
    sessions = {"as written": generator.runner.session, "decode graph": decode.session}
    print("| round | steps through | rows | step ms (median) |\n|---|---|---|---|")
    for n in range(args.rounds):
        for name, session in sessions.items():
            for batch in (int(b) for b in args.batches.split(",")):
                rows = SharedRows(generator, batch, args.prompt + args.steps + 8)
                step = timed_steps(rows, args.prompt, args.steps, np.random.default_rng(0),
                                   session)  # (the joins through the file as written)
                print(f"| {n + 1} | {name} | {batch} | {1e3 * step:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
