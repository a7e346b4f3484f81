"""Weights in 4 and 8 bits: `mha-onnx quantize` of the fused Optimum Llama against its float
fusion and ORT GenAI's int4 graph of the same weights: size, prompt and decode step times
(timed in turn in one process), and accuracy against the float model on the same inputs.

    .venv-optimum/bin/python -m tools.bench_optimum make DIR [--layers N]
    .venv-genai/bin/python -m tools.bench_optimum genai DIR --precision int4
    .venv/bin/python -m tools.benchmark quantize DIR [--prompt 16,64,1024] [--context 1024]
        [--threads 2] [--min-time 1] [--reverse] [--accuracy-levels 0,1] [--spinning]
        [--steps 20] [--out FILE.md]

The float model: the Optimum export fused with --kv-cache shared; ours: it quantized (int4
block 32 symmetric accuracy level 4, as GenAI's CPU default; int8 the same); GenAI's graph
from its builder's `-p int4 -e cpu`; and the int4 file's decode graph (decode steps only:
the graph `mha-onnx generate` runs them through, generate/decode.py). Accuracy: the
next-token distributions of a batch of 4 random 64-token prompts against the float model's
(KL, top-1), the logits' cosine, and greedy agreement over 32 tokens from the prompts'
first 16 (GenAI's graph run by `mha-onnx generate` with its shared buffers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tools import suite


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir()
               if p.name == path.name or p.name.startswith(path.name + "."))


def graphs(folder: Path, levels: tuple[int, ...] = ()) -> dict[str, Path]:
    from mha_onnx.quantize.run import quantize_file
    from mha_onnx.quantize.weights import QuantizeConfig
    from tools.bench_generate import fused

    float_model = fused(folder)
    out = {"fp32 (fuse --kv-cache shared)": float_model}
    variants = [(f"--weights {w}", f"quantized-{w}", QuantizeConfig(weights=w))
                for w in ("int4", "int8")]
    variants += [(f"--accuracy-level {n}", f"quantized-int4-level{n}",  # 0: float compute
                  QuantizeConfig(accuracy_level=n)) for n in levels]
    for label, name, config in variants:
        path = folder / name / "model.onnx"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            quantize_file(float_model, path, config, sensitivity=False, check=False,
                          force=True)
        out[f"mha-onnx quantize {label}"] = path
    out[DECODE] = _decode_graph(out["mha-onnx quantize --weights int4"])
    out["ORT GenAI builder -p int4"] = folder / "genai-int4" / "model.onnx"
    return out


DECODE = "int4, decode graph (the steps generate runs)"


def _decode_graph(path: Path) -> Path:
    """The int4 file's decode graph (generate/decode.py: its Ifs replaced by their fast
    branches, the guard an output), written beside it: a step as ``mha-onnx generate``
    runs it. Decode steps only (a prompt is run through the file as written)."""
    from mha_onnx.generate.decode import decode_graph
    from mha_onnx.graph.files import read_model, write_model

    out = path.parent / "decode.onnx"
    if not out.exists():
        write_model(decode_graph(read_model(path)), out, force=True)
    return out


def accuracy_rows(models: dict[str, Path]) -> list[tuple]:
    from mha_onnx.generate import GenerationConfig, Generator
    from mha_onnx.graph.files import read_model
    from mha_onnx.quantize import accuracy
    from mha_onnx.quantize.feeds import decoder_feeds, session_outputs

    base = next(iter(models.values()))
    feeds, prompts = decoder_feeds(read_model(base, load_external_data=False), str(base),
                                    accuracy.PROMPTS, accuracy.PROMPT_LENGTH, seed=0)
    want = session_outputs(str(base), feeds)["logits"]
    settings = GenerationConfig(accuracy.NEW_TOKENS, eos=())
    starts = [p[:16] for p in prompts]
    with Generator(base) as generator:
        reference = generator.generate(starts, settings).sequences
    rows = []
    for label, path in list(models.items())[1:]:
        if label == DECODE:  # (the int4 file's computations: its tokens are tested equal)
            continue
        got = session_outputs(str(path), feeds)["logits"]
        kl, agree = accuracy.kl_top1(want, got)
        cosine = accuracy.output_error("logits", want, got).cosine
        with Generator(path) as generator:  # (GenAI's: read from its genai_config.json)
            share, same = accuracy.greedy_agreement(
                reference, generator.generate(starts, settings).sequences)
        rows.append((label, f"{kl.mean():.4f}", f"{kl.max():.4f}", f"{agree.mean():.3f}",
                     f"{cosine:.4f}", f"{share:.3f} ({same}/{len(starts)} rows identical)"))
    return rows


def timing_rows(models: dict[str, Path], args) -> list[tuple]:
    from mha_onnx.runtime.ort import OrtRunner
    from tools.bench_optimum_run import _feeds, _step, _time

    runners = {k: OrtRunner(v, threads=args.threads, spinning=args.spinning,
                            stop_spinning=args.spinning) for k, v in models.items()}
    order = list(runners)[::-1] if args.reverse else list(runners)  # (the order they are made)
    times = {}
    phases = [(f"prompt {n}", n, 0) for n in args.prompt] + [("decode", 1, args.context)]
    for phase, new, past in phases:
        runs = {}
        for label in order:
            if past == 0 and label == DECODE:
                continue
            runner = runners[label]
            kind = "genai" if "GenAI" in label else "shared"
            feeds, pasts = _feeds(kind, runner.input_names, 1, new, past,
                                  np.random.default_rng(0))
            runs[label] = _in_a_row(_step(runner, kind, feeds, pasts)[0],
                                    args.steps if past else 1)
        steps = args.steps if past else 1
        times[phase] = {k: ms / steps for k, ms in _time(runs, args.min_time).items()}
    base = next(iter(models))
    rows = []
    for label, path in models.items():
        row = [label, f"{_bytes(path) / 1e6:.1f}", f"{_bytes(path) / _bytes(models[base]):.2f}x"]
        for phase, _, _ in phases:
            if label not in times[phase]:
                row += ["-", "-"]
                continue
            row += [f"{times[phase][label]:.{2 if phase == 'decode' else 1}f}",
                    f"{times[phase][label] / times[phase][base]:.2f}x"]
        rows.append(tuple(row))
    return rows


def _in_a_row(run, steps: int):
    """``run`` ``steps`` times in a row: the graphs still take turns (one turn = ``steps``
    steps), but each step follows its own graph's last, as in a generation loop, instead of
    another graph's (whose weights evict this one's from the caches)."""
    if steps == 1:
        return run

    def many() -> None:
        for _ in range(steps):
            run()
    return many


def kernel_times(models: dict[str, Path], args) -> list[str]:
    """Each graph's decode step under ORT's profiler (20 steps): kernels per step and
    microseconds per op type (an If's time is its branches' kernels, not counted again)."""
    import tempfile
    from collections import Counter

    from mha_onnx.runtime.ort import OrtRunner, read_profile
    from tools.bench_optimum_run import _feeds, _step

    lines, steps = [], 20
    for label, path in models.items():
        kind = "genai" if "GenAI" in label else "shared"
        with tempfile.TemporaryDirectory() as folder:
            runner = OrtRunner(path, threads=args.threads, spinning=False, profile_dir=folder)
            feeds, pasts = _feeds(kind, runner.input_names, 1, 1, args.context,
                                  np.random.default_rng(0))
            step = _step(runner, kind, feeds, pasts)[0]
            for _ in range(steps):
                step()
            events = [e for e in read_profile(runner.end_profiling()) if e.op_type != "If"]
        micros, count = Counter(), Counter()
        for event in events:
            micros[event.op_type] += event.micros / steps
            count[event.op_type] += 1 / steps
        top = ", ".join(f"{op} x{count[op]:.0f} {us:.0f} us" for op, us in micros.most_common(5))
        lines.append(f"- {label}: {len(events) / steps:.0f} kernels per step, "
                     f"{sum(micros.values()) / 1e3:.2f} ms of kernel time; {top}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = suite.parser(__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prompt", type=suite.ints, default=(1024,),
                        help="prompt lengths timed (e.g. 16,64,256,1024)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--accuracy-levels", type=suite.ints, default=(),
                        help="also int4 at these MatMulNBits accuracy levels (e.g. 0,1)")
    parser.add_argument("--kernels", action="store_true",
                        help="instead of timing: each graph's decode step under ORT's profiler")
    parser.add_argument("--reverse", action="store_true",
                        help="make the sessions in the reverse order of the table")
    parser.add_argument("--spinning", action="store_true",
                        help="thread pools spin within a run and stop after it (ORT's default "
                             "within a run, as generate runs); else they sleep")
    parser.add_argument("--steps", type=int, default=1,
                        help="decode steps each graph runs in a row per turn (1: the graphs "
                             "alternate every step; a generation loop runs its own in a row)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps: at least 1")
    suite.quiet()
    models = graphs(args.folder, args.accuracy_levels)
    if args.kernels:
        suite.emit(kernel_times(models, args), args.out)
        return 0
    timed = timing_rows(models, args)
    accurate = accuracy_rows(models)
    command = suite.command("quantize", argv)
    pools = ", pools spinning within a run" if args.spinning else ", pools sleeping"
    pools += f", decode steps {args.steps} in a row per turn" if args.steps > 1 else ""
    lines = [suite.measured(command, f"batch 1, {args.threads} threads{pools}, timed in turn "
                                     "in one process" + (", sessions made in reverse order"
                                                         if args.reverse else "")), "",
             "| graph | MB | size | " + "".join(f"prompt {n} ms | ratio | " for n in args.prompt)
             + f"decode step, context {args.context} ms | ratio |",
             "|---" * (5 + 2 * len(args.prompt)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in timed]
    lines += ["", "Accuracy against the float model (4 prompts x 64 tokens; greedy: 32 tokens "
                  "from their first 16):", "",
              "| graph | KL mean | KL max | top-1 | logits cosine | greedy agreement |",
              "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in accurate]
    suite.emit(["", *lines], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
