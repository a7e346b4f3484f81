"""What `generate`'s decode graph (mha_onnx/generate/decode.py) saves a step: one quantized
shared-cache fusion run by two generators that differ in that alone, both with the float
prompt's session (the generator's default on a CPU without VNNI; asked for here on any),
so their thread pools and prompts are alike: one runs its steps through the decode graph,
the other through the file as written (its Ifs). Batch 1, greedy, no
EOS; the generators take turns, the order reversed every round; ms per step, median and
best of the rounds.

    .venv/bin/python -m tools.experiments.decode_graph QUANTIZED.onnx [--rounds 8]
        [--prompt 128] [--new 64] [--batch 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

from mha_onnx.generate import GenerationConfig, Generator, decode
from mha_onnx.profile.roofline import cpu_isa, cpu_name


def generators(path: str, threads: int) -> dict[str, Generator]:
    made, real = {}, decode.decode_graph
    try:
        for label, graph in (("steps on the decode graph", real),
                             ("steps through the file as written", lambda model: None)):
            decode.decode_graph = graph
            made[label] = Generator(path, threads=threads, float_prompt=True)
    finally:
        decode.decode_graph = real
    if not next(iter(made.values())).steps_only:
        raise SystemExit(f"{path}: no decode graph (not a quantized shared-cache fusion)")
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="rows of one length")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    made = generators(args.model, args.threads)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 500, args.prompt)) for _ in range(args.batch)]
    times: dict[str, list[float]] = {label: [] for label in made}
    for r in range(args.rounds):
        for label in list(made)[::1 if r % 2 == 0 else -1]:
            result = made[label].generate(prompts, GenerationConfig(args.new, eos=()))
            times[label].append(1e3 * result.decode_seconds / result.steps)
    base = statistics.median(times[list(made)[1]])
    isa = f" ({cpu_isa()})" if cpu_isa() else ""
    print(f"{cpu_name()}{isa}, {os.cpu_count()} CPUs; batch {args.batch}, prompt {args.prompt}, "
          f"{args.new} new tokens, {args.rounds} rounds\n")
    print("| generator | ms per step, median | best | vs as written |\n|---|---|---|---|")
    for label, values in times.items():
        median = statistics.median(values)
        print(f"| {label} | {median:.3f} | {min(values):.3f} | {median / base:.3f}x |")


if __name__ == "__main__":
    main()
