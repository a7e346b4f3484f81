"""The batch-1 decode step, side by side: our int4 file through `generate`'s loop, ORT GenAI's
int4 graph through GenAI's generator, and llama.cpp's Q4_0 of the same weights through
llama-cpp-python, each in a worker process of its own environment, timed in interleaved
rounds on one machine.

    .venv/bin/python -m tools.bench_step DIR [--prompt 512] [--steps 128] [--rounds 7]
        [--threads 2] [--out FILE.md] [--also LABEL=MODEL.onnx ...]

DIR as tools/bench_serve.py's (int4/, genai-int4/, llama16-q4_0.gguf). Each round, each
worker runs one request alone: a ``--prompt``-token prompt (the same ids for all), then
``--steps`` greedy tokens with EOS ignored; it reports its time to first token and the
median time per token after it (``--also``: more of our files through the same loop, e.g.
another --block-size). The table gives each engine's median over the rounds and
the per-round ratios to ours. Workers start once and stay loaded; the order of the
workers rotates each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OURS = r'''
import json, sys, time
import numpy as np
from mha_onnx.generate import GenerationConfig, Generator
threads = int(sys.argv[2])
generator = Generator(sys.argv[1], threads=threads)
for line in sys.stdin:
    ids, steps = json.loads(line)
    tokens, stamps = [], []
    start = time.perf_counter()
    result = generator.generate([ids], GenerationConfig(max_new_tokens=steps + 1, eos=()),
                                on_step=lambda done, total: stamps.append(time.perf_counter()))
    gaps = np.diff(stamps)
    print(json.dumps({"ttft": stamps[0] - start, "step": float(np.median(gaps)),
                      "tokens": len(result.sequences[0])}), flush=True)
'''

GENAI = r'''
import json, sys, time
import numpy as np
import onnxruntime_genai as og
config = og.Config(sys.argv[1])
config.clear_providers()
model = og.Model(config)
for line in sys.stdin:
    ids, steps = json.loads(line)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + steps + 1, min_length=len(ids) + steps + 1,
                              do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(np.array([ids], np.int32))
    stamps = []
    while not generator.is_done():
        generator.generate_next_token()
        stamps.append(time.perf_counter())
    print(json.dumps({"ttft": stamps[0] - start, "step": float(np.median(np.diff(stamps))),
                      "tokens": len(stamps)}), flush=True)
'''

LLAMA = r'''
import json, sys, time
import numpy as np
from llama_cpp import Llama
threads = int(sys.argv[2])
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[3]), n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False, logits_all=False)
eos = llm.token_eos()
for line in sys.stdin:
    ids, steps = json.loads(line)
    llm.reset()
    start = time.perf_counter()
    stamps = []
    for n, token in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True,
                                           logits_processor=[lambda _, scores: _ban(scores)])):
        stamps.append(time.perf_counter())
        if n + 1 >= steps + 1:
            break
    print(json.dumps({"ttft": stamps[0] - start, "step": float(np.median(np.diff(stamps))),
                      "tokens": len(stamps)}), flush=True)
'''
LLAMA = LLAMA.replace("for line in sys.stdin:", "def _ban(scores):\n    scores[eos] = -np.inf\n"
                      "    return scores\n\nfor line in sys.stdin:", 1)


def workers(folder: Path, threads: int, also: list[str], context: int = 2048
            ) -> dict[str, list[str]]:
    """Each engine's worker command; ``context``: llama.cpp's context size."""
    def ours(model: Path) -> list[str]:
        return [str(ROOT / ".venv/bin/python"), "-c", OURS, str(model), str(threads)]

    return {
        "mha-onnx generate (int4, shared cache)": ours(folder / "int4" / "model.onnx"),
        "ORT GenAI generator (its int4 graph)": [str(ROOT / ".venv-genai-rt/bin/python"), "-c",
                                                 GENAI, str(folder / "genai-int4"),
                                                 str(threads)],
        "llama.cpp (llama-cpp-python, Q4_0)": [str(ROOT / ".venv-llama/bin/python"), "-c", LLAMA,
                                               str(folder / "llama16-q4_0.gguf"), str(threads),
                                               str(context)],
        **{f"mha-onnx generate ({label})": ours(Path(path).resolve())
           for label, _, path in (a.partition("=") for a in also)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--also", action="append", default=[], metavar="LABEL=MODEL.onnx")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tools.loadgen import whole_words

    words = list(whole_words(str(args.dir / "hf")))
    import numpy as np

    ids = [int(words[i]) for i in np.random.default_rng(0).integers(0, len(words), args.prompt)]
    env = {"OMP_NUM_THREADS": str(args.threads), "PATH": "/usr/bin:/bin"}
    procs = {name: subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
             for name, cmd in workers(args.dir, args.threads, args.also,
                                      max(2048, args.prompt + args.steps + 16)).items()}
    names = list(procs)
    results: dict[str, list[dict]] = {n: [] for n in names}
    request = json.dumps([ids, args.steps]) + "\n"
    for name in names:  # (warm: sessions made, weights paged in)
        procs[name].stdin.write(json.dumps([ids[:32], 8]) + "\n")
        procs[name].stdin.flush()
        procs[name].stdout.readline()
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            procs[name].stdin.write(request)
            procs[name].stdin.flush()
            line = procs[name].stdout.readline()
            if not line:
                raise SystemExit(f"{name}'s worker stopped at a {args.prompt}-token prompt "
                                 f"(run its command alone to see why: {procs[name].args[:1]})")
            results[name].append(json.loads(line))
            time.sleep(0.5)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait(60)
    ours = names[0]
    lines = [f"| engine | decode ms/token (median of {args.rounds} rounds) | vs ours, per round "
             "(min-max) | first token ms (median) |", "|---|---|---|---|"]
    for name in names:
        steps = [r["step"] * 1e3 for r in results[name]]
        ratios = [r["step"] / o["step"] for r, o in zip(results[name], results[ours],
                                                        strict=True)]
        lines.append(f"| {name} | {statistics.median(steps):.2f} | {min(ratios):.3f}-"
                     f"{max(ratios):.3f} | "
                     f"{statistics.median(r['ttft'] * 1e3 for r in results[name]):.0f} |")
    from mha_onnx.profile.roofline import cpu_isa, cpu_name

    text = (f"{time.strftime('%Y-%m-%d')}, {cpu_name()} ({cpu_isa()}), {args.threads} threads; "
            f"`python -m tools.bench_step {' '.join(sys.argv[1:] if argv is None else argv)}`"
            f"\n\n" + "\n".join(lines) + "\n")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
