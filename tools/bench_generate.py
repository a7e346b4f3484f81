"""Tokens per second and time to the first token: `mha-onnx generate` against ONNX Runtime
GenAI's generator (on the same fused graph, and on GenAI's own graph of the same weights)
and against transformers.generate in PyTorch.

    .venv-optimum/bin/python -m tools.bench_optimum make DIR [--vocab 32000]  # HF + Optimum
    .venv-genai/bin/python -m tools.bench_optimum genai DIR                   # GenAI's graph
    .venv/bin/python -m tools.benchmark generate DIR [--batch 1,8] [--prompt 128,1024]
        [--new 128] [--threads 2] [--rounds 3] [--no-torch] [--quantized] [--out FILE.md]

Greedy, no EOS (every row runs ``--new`` tokens), prompts of random ids, rows of one length.
Our side: the Optimum export fused with ``--kv-cache shared`` (the form GenAI's generator
runs in place; the fused folder has genai_config.json), run by `mha-onnx generate`'s
library. GenAI's generator runs in its own environment (make genai-env) on the same file
and on GenAI's graph. Every runner runs in a fresh child process of its environment per
run (PyTorch in this one: it is not timed beside ORT's pools), each runner timed in turn
for ``--rounds`` rounds (the best round of each is reported; the per-round spread says the
noise). Time per token: the decode steps' time / steps; prompt: the time to the first
token. A floor beside them: the same graph's runs alone, bound once, without sampling.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mha_onnx.rewrite.policy import FormPolicy
from tools import suite

ROOT = Path(__file__).resolve().parents[1]
GENAI_PY = ROOT / ".venv-genai-rt" / "bin" / "python"


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(3, vocab - 1, (batch, length)).tolist()


def fused(folder: Path, logits: str = "all") -> Path:
    """The Optimum export fused with a shared cache (its folder: genai_config.json too)."""
    from mha_onnx.rewrite import fuse_file

    out = folder / f"fused-shared{'-last' if logits == 'last' else ''}" / "model.onnx"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fuse_file(folder / "optimum" / "model.onnx", out, logits=logits,
                  policy=FormPolicy(kv_cache="shared"), force=True)
    return out


def ours(model: Path, prompts, new: int, threads: int | None, float_prompt: bool | None = None
         ) -> dict:
    from mha_onnx.generate import GenerationConfig, Generator

    with Generator(model, threads=threads, float_prompt=float_prompt) as generator:
        generator.generate(prompts[:1], GenerationConfig(4, eos=()))  # warm-up
        result = generator.generate(prompts, GenerationConfig(new, eos=()))
    return {"ttft_ms": result.time_to_first_token_ms,
            "ms_per_token": 1e3 * result.decode_seconds / max(1, result.steps),
            "ort_share": result.ort_seconds / result.seconds,
            "first": list(result.sequences[0][:8])}


def bare(model: Path, prompts, new: int, threads: int | None) -> dict:
    """The floor: ONNX Runtime's runs alone on the same graph, every input bound once but
    the token, the mask and the position (no sampling: the argmax of row 0 only)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    batch, length = len(prompts), len(prompts[0])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    kv, head = pasts[0].shape[1], pasts[0].shape[3]
    binding = session.io_binding()
    for past in pasts:
        value = ort.OrtValue.ortvalue_from_numpy(
            np.zeros((batch, kv, length + new, head), np.float32))
        binding.bind_ortvalue_input(past.name, value)
        binding.bind_ortvalue_output(past.name.replace("past_key_values", "present"), value)
    vocab = session.get_outputs()[0].shape[2]
    names = {i.name for i in session.get_inputs()}

    def run(ids: np.ndarray, width: int) -> np.ndarray:
        """One run of ``ids`` with ``width`` keys (mask all ones); its logits."""
        rows = ids.shape[1]
        logits = np.empty((batch, rows, vocab), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape),
                            logits.ctypes.data)
        positions = np.tile(np.arange(width - rows, width), (batch, 1))
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, width), np.int64),
                 "position_ids": positions}
        for name in names & feeds.keys():
            binding.bind_cpu_input(name, feeds[name])
        session.run_with_iobinding(binding)
        return logits

    started = time.perf_counter()
    token = int(run(np.array(prompts, np.int64), length)[0, -1].argmax())
    first = time.perf_counter()
    one = np.full((batch, 1), token, np.int64)
    for step in range(1, new):
        run(one, length + step)
    done = time.perf_counter()
    return {"ttft_ms": 1e3 * (first - started), "ms_per_token": 1e3 * (done - first) / (new - 1),
            "first": [token]}


def genai(folder: Path, prompts, new: int, threads: int | None) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(prompts, handle)
    command = [str(GENAI_PY), str(ROOT / "tools" / "genai_generate.py"), str(folder),
               "--prompts", handle.name, "--max-new-tokens", str(new), "--no-eos",
               "--repeat", "2"] + (["--threads", str(threads)] if threads else [])
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"ttft_ms": out["time_to_first_token_ms"], "ms_per_token": out["ms_per_step"],
            "first": out["sequences"][0][:8]}


def torch_generate(hf: Path, prompts, new: int, threads: int | None) -> dict:
    import torch
    import transformers as tf

    if threads:
        torch.set_num_threads(threads)
    model = tf.AutoModelForCausalLM.from_pretrained(hf, local_files_only=True).eval()
    ids = torch.tensor(prompts)
    timings = {}
    with torch.no_grad():
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False)  # warm-up
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        timings["ttft_ms"] = 1e3 * (time.perf_counter() - started)
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        total = time.perf_counter() - started
    timings["ms_per_token"] = (1e3 * total - timings["ttft_ms"]) / (new - 1)
    timings["first"] = out[0, ids.shape[1]:ids.shape[1] + 8].tolist()
    return timings


def in_child(runner: str, model: Path, prompts, new: int, threads: int | None) -> dict:
    """``runner`` (ours or bare) in a fresh process of this environment, as GenAI's
    generator runs in one of its own: nothing else of the benchmark's in its memory or
    thread pools."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(prompts, handle)
    done = subprocess.run([sys.executable, "-m", "tools.bench_generate", "--child", runner,
                           str(model), handle.name, str(new), str(threads or 0)],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(argv: list[str]) -> int:
    runner, model, prompts, new, threads = argv
    prompts = json.loads(Path(prompts).read_text())
    chosen = {"ours": ours, "bare": bare,
              "ours-as-written": lambda *a: ours(*a, float_prompt=False),
              "ours-float": lambda *a: ours(*a, float_prompt=True)}[runner]
    out = chosen(Path(model), prompts, int(new), int(threads) or None)
    print(json.dumps(out))
    return 0


def run(args, command: str) -> list[str]:
    folder = args.folder
    vocab = json.loads((folder / "hf" / "config.json").read_text())["vocab_size"]
    model = fused(folder)
    if args.quantized:
        return _rows(args, command, vocab, _quantized_runners(folder, model, args),
                     "GenAI generator, same int4 graph")
    runners = {"mha-onnx generate (fused, shared)": lambda p: in_child(
                   "ours", model, p, args.new, args.threads),
               "bare bound ORT runs (same graph, floor)": lambda p: in_child(
                   "bare", model, p, args.new, args.threads),
               "GenAI generator, same graph": lambda p: genai(model.parent, p, args.new,
                                                              args.threads),
               "GenAI generator, GenAI's graph": lambda p: genai(folder / "genai", p, args.new,
                                                                 args.threads)}
    if not args.no_torch:
        runners["transformers.generate (PyTorch)"] = lambda p: torch_generate(
            folder / "hf", p, args.new, args.threads)
    return _rows(args, command, vocab, runners, "GenAI generator, same graph")


def _quantized_runners(folder: Path, model: Path, args) -> dict:
    """The float fusion, it quantized to int4 (tools/bench_quantize): as the generator runs
    it by default (its prompt in float compute and its steps on the decode graph on a CPU
    without VNNI, else the file as written), with the float prompt asked for (Generator(
    float_prompt=True): the default without VNNI, on any CPU), as written
    (--prompt-as-written), and GenAI's generator on it and on GenAI's int4 graph
    (``bench_optimum genai DIR --precision int4``)."""
    from tools.bench_quantize import graphs

    q4 = graphs(folder)["mha-onnx quantize --weights int4"]

    def ours_as(runner: str, path: Path):
        return lambda p: in_child(runner, path, p, args.new, args.threads)

    return {"mha-onnx generate, fp32 fused": ours_as("ours", model),
            "mha-onnx generate, int4 (the default on this CPU)": ours_as("ours", q4),
            "mha-onnx generate, int4 (float prompt, steps on the decode graph)": ours_as(
                "ours-float", q4),
            "mha-onnx generate, int4 (--prompt-as-written)": ours_as("ours-as-written", q4),
            "GenAI generator, same int4 graph": lambda p: genai(q4.parent, p, args.new,
                                                                args.threads),
            "GenAI generator, GenAI's int4 graph": lambda p: genai(
                folder / "genai-int4", p, args.new, args.threads)}


def _rows(args, command: str, vocab: int, runners: dict, base_name: str) -> list[str]:
    rows = []
    for batch in args.batch:
        for length in args.prompt:
            prompts = _prompts(batch, length, vocab)
            seen: dict[str, list[dict]] = {name: [] for name in runners}
            for _ in range(args.rounds):
                for name, runner in runners.items():
                    seen[name].append(runner(prompts))
            base = min(r["ms_per_token"] for r in seen[base_name])
            first = min(r["ttft_ms"] for r in next(iter(seen.values())))
            for name, results in seen.items():
                step = sorted(r["ms_per_token"] for r in results)
                ttft = sorted(r["ttft_ms"] for r in results)
                rows.append((batch, length, name, f"{ttft[0]:.1f}", f"{ttft[0] / first:.2f}x",
                             f"{step[0]:.2f} ({step[0]:.2f}-{step[-1]:.2f})",
                             f"{batch * 1e3 / step[0]:.0f}", f"{step[0] / base:.2f}x",
                             str(results[0]["first"][:4])))
            print(f"batch {batch}, prompt {length}: done", file=sys.stderr, flush=True)
    header = ["batch", "prompt", "runner", "first token ms (best)", "vs first row",
              "ms per token, best (range)", "tokens/s", f"vs {base_name}",
              "first tokens"]
    lines = [suite.measured(command, f"{args.new} new tokens, greedy, no EOS; threads "
                                     f"{args.threads}; {args.rounds} rounds, each runner in "
                                     "turn"), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    parser = suite.parser(__doc__, min_time=None)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--prompt", type=lambda s: [int(x) for x in s.split(",")],
                        default=[128, 1024])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--quantized", action="store_true",
                        help="int4: the float fusion beside it quantized, and GenAI's int4 "
                             "graph (make it with bench_optimum genai DIR --precision int4)")
    args = parser.parse_args(argv)
    suite.quiet()
    suite.emit(run(args, suite.command("generate", argv)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
