"""Decode steps of several graphs of the same weights (our shared-cache fusions, quantized or
not, and ORT GenAI's graph: a path with 'genai' in it), as a generation loop runs them: each
graph runs ``--steps`` steps in a row per turn at batch 1 after ``--context`` cached
positions, the graphs take turns (the order rotated every round), thread pools sleep
between runs, 2 threads; ms per step, median of the rounds, and each round's figure (the
spread between rounds is the noise to read the medians against).

    .venv/bin/python -m tools.experiments.steps_in_a_row A.onnx B.onnx [...] [--rounds 8]
        [--steps 20] [--context 1024]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from mha_onnx.runtime.ort import OrtRunner
from tools.bench_optimum_run import _feeds, _step, _time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    runs = {}
    for path in args.models:
        kind = "genai" if "genai" in path else "shared"
        runner = OrtRunner(path, threads=2, spinning=False)
        feeds, past = _feeds(kind, runner.input_names, 1, 1, args.context,
                             np.random.default_rng(0))
        step = _step(runner, kind, feeds, past)[0]

        def in_a_row(step=step) -> None:
            for _ in range(args.steps):
                step()
        runs[path] = in_a_row
    times: dict[str, list[float]] = {path: [] for path in runs}
    labels = list(runs)
    for r in range(args.rounds):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for path, ms in _time({k: runs[k] for k in order}, 0.5).items():
            times[path].append(ms / args.steps)
    print("| graph | ms per step, median | rounds |\n|---|---|---|")
    for path, values in times.items():
        print(f"| {path} | {statistics.median(values):.3f} | "
              f"{', '.join(f'{v:.3f}' for v in values)} |")


if __name__ == "__main__":
    main()
