"""Many users at once: `mha-onnx serve` (continuous batching, and --max-batch 1) against ONNX
Runtime GenAI (its generator one request at a time, and its engine's batches) and llama.cpp's
OpenAI server (llama-cpp-python, the same weights in GGUF Q4_0), on one machine, one server at
a time, the same requests (tools/loadgen.py) at each concurrency.

    .venv/bin/python -m tools.bench_serve DIR [--concurrency 1,4,16,64] [--requests 64]
        [--prompt 32:1024] [--output 16:256] [--time-limit 900] [--servers ours,ours-b1,...]
        [--threads 2] [--out docs/serve-bench.md] [--merge docs/serve-bench.json]

DIR is the bench folder of tools/bench_optimum (``make DIR --layers 16``, then ``genai DIR
--precision int4``) with, beside it: ``int4/`` (our int4 folder: the Optimum export fused
with --kv-cache shared, then ``quantize --weights int4``), ``w8a8/`` (the same fused file
``quantize --weights w8a8``: int8 weights, int8 activations per row) and ``llama16-q4_0.gguf``
(tools/gguf_anchor.py). Each server starts, is warmed with one request, serves
every concurrency in turn, and stops before the next starts. Results: a markdown table (the
date, machine and command at its head), a JSON file beside it, and a plot of output tokens/s
and p99 inter-token latency against concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def servers(folder: Path, threads: int) -> dict[str, tuple[list[str], str]]:
    """name -> (command with {port}, loadgen style)."""
    ours, w8a8 = ([str(ROOT / ".venv" / "bin" / "mha-onnx"), "serve", str(folder / weights),
                   "--max-length", "1400", "--threads", str(threads), "--max-queue", "256",
                   "--port", "{port}"] for weights in ("int4", "w8a8"))
    genai = [str(ROOT / ".venv-genai-rt" / "bin" / "python"), str(ROOT / "tools" /
             "genai_server.py"), str(folder / "genai-int4"), "--port", "{port}"]
    llama = [str(ROOT / ".venv-llama" / "bin" / "python"), "-m", "llama_cpp.server",
             "--model", str(folder / "llama16-q4_0.gguf"), "--n_ctx", "1400", "--n_threads",
             str(threads), "--n_threads_batch", str(threads), "--port", "{port}",
             "--interrupt_requests", "False"]  # (its default cuts a stream at the next request)
    return {"mha-onnx serve (continuous, --max-batch 16)": (ours + ["--max-batch", "16"], "ours"),
            "mha-onnx serve (continuous, --prefill-chunk 64)": (
                ours + ["--max-batch", "16", "--prefill-chunk", "64"], "ours"),
            "mha-onnx serve (continuous, --prefill-chunk 16)": (
                ours + ["--max-batch", "16", "--prefill-chunk", "16"], "ours"),
            "mha-onnx serve --max-batch 1": (ours + ["--max-batch", "1"], "ours"),
            "mha-onnx serve, w8a8 (continuous, --max-batch 16)": (w8a8 + ["--max-batch", "16"],
                                                                  "ours"),
            "mha-onnx serve, w8a8 (continuous, --prefill-chunk 64)": (
                w8a8 + ["--max-batch", "16", "--prefill-chunk", "64"], "ours"),
            "mha-onnx serve, w8a8 (continuous, --prefill-chunk 16)": (
                w8a8 + ["--max-batch", "16", "--prefill-chunk", "16"], "ours"),
            "mha-onnx serve, w8a8 (continuous, --prefill-chunk 8)": (
                w8a8 + ["--max-batch", "16", "--prefill-chunk", "8"], "ours"),
            "mha-onnx serve, w8a8 (continuous, --prefill-chunk 16, --no-mixed-steps)": (
                w8a8 + ["--max-batch", "16", "--prefill-chunk", "16", "--no-mixed-steps"],
                "ours"),
            "mha-onnx serve, w8a8 --max-batch 1": (w8a8 + ["--max-batch", "1"], "ours"),
            "ORT GenAI generator (one at a time)": (genai + ["--mode", "generator"], "ours"),
            "ORT GenAI engine (static batching, 16)": (genai + ["--mode", "engine",
                                                                "--max-batch", "16"], "ours"),
            "llama.cpp server (llama-cpp-python, Q4_0)": (llama, "llama-cpp")}


SHORT = {"ours": "mha-onnx serve (continuous, --max-batch 16)",
         "ours-c64": "mha-onnx serve (continuous, --prefill-chunk 64)",
         "ours-c16": "mha-onnx serve (continuous, --prefill-chunk 16)",
         "ours-b1": "mha-onnx serve --max-batch 1",
         "ours-w8a8": "mha-onnx serve, w8a8 (continuous, --max-batch 16)",
         "ours-w8a8-c64": "mha-onnx serve, w8a8 (continuous, --prefill-chunk 64)",
         "ours-w8a8-c16": "mha-onnx serve, w8a8 (continuous, --prefill-chunk 16)",
         "ours-w8a8-c8": "mha-onnx serve, w8a8 (continuous, --prefill-chunk 8)",
         "ours-w8a8-c16-apart": "mha-onnx serve, w8a8 (continuous, --prefill-chunk 16, "
                                "--no-mixed-steps)",
         "ours-w8a8-b1": "mha-onnx serve, w8a8 --max-batch 1",
         "genai": "ORT GenAI generator (one at a time)",
         "genai-engine": "ORT GenAI engine (static batching, 16)",
         "llama-cpp": "llama.cpp server (llama-cpp-python, Q4_0)"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, process: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            httpx.get(url + "/v1/models", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(1)
    raise RuntimeError("the server did not answer")


def load(url: str, style: str, args, concurrency: int, requests: int) -> dict:
    command = [sys.executable, "-m", "tools.loadgen", url, "--concurrency", str(concurrency),
               "--requests", str(requests), "--prompt", args.prompt, "--output", args.output,
               "--time-limit", str(args.time_limit), "--style", style,
               "--tokenizer", str(args.dir / "hf"), "--seed", str(args.seed)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    if not lines:
        return {"error": done.stderr.strip()[-300:]}
    return json.loads(lines[-1])


def bench_server(name: str, command: list[str], style: str, args) -> dict[int, dict]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    process = subprocess.Popen([c.replace("{port}", str(port)) for c in command], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    results = {}
    try:
        _wait(url, process)
        load(url, style, args, 1, 1)  # (warm: sessions made, pools started)
        for concurrency in args.concurrency:
            requests = max(args.requests, 2 * concurrency)
            print(f"{name}: {concurrency} clients, {requests} requests", file=sys.stderr,
                  flush=True)
            results[concurrency] = load(url, style, args, concurrency, requests)
            print(f"  {json.dumps(results[concurrency])}", file=sys.stderr, flush=True)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    return results


PAGE = """# Serving many users at once: measured

{date}, {cpu} ({isa}), {cores} cores, every server with the same threads; made by (each
command measures the servers it names; `--merge` keeps the rows of the run before)

    {command}

The same requests at each concurrency (tools/loadgen.py: prompts and output lengths drawn
uniformly from the ranges, greedy, `ignore_eos` so every request runs to its length, every
answer streamed), one server at a time on one quiet machine. The weights are one
16-layer hidden-1024 Llama-like model (tools/bench_optimum `make DIR --layers 16`): ours
is its Optimum export fused with `--kv-cache shared` and quantized with `--weights int4`
(MatMulNBits, block 32), or with `--weights w8a8` where the row says so (int8 weights per
column, int8 activations per row, ORT's integer GEMM); ONNX Runtime GenAI's is its builder's `-p int4` of the same
folder; llama.cpp's is the folder converted by llama-cpp-python's `convert_hf_to_gguf.py`
and quantized to Q4_0 (tools/gguf_anchor.py). TTFT: time to the first streamed token; ITL: time between two
tokens of one stream.

{table}

{ratios}

![output tokens/s and p99 inter-token latency against concurrent clients]({plot})
"""


def _rate(points: dict, clients: int) -> float | None:
    r = points.get(clients) or {}
    return r.get("output_tokens_per_s") if "error" not in r else None


def ratios(results: dict[str, dict[int, dict]]) -> list[str]:
    """The comparisons the issue asks for, computed from this run's figures: each
    continuous-batching server (int4, w8a8) against the --max-batch 1 servers and the
    anchors, and its p99 inter-token latency against its own single client's."""
    lines = []
    for mine_short, label in (("ours", "continuous batching"),
                              ("ours-w8a8", "w8a8 continuous batching")):
        ours = results.get(SHORT[mine_short], {})
        for clients in sorted(ours):
            mine = _rate(ours, clients)
            for short in ("ours-b1", "ours-w8a8-b1", "genai", "genai-engine", "llama-cpp"):
                other = _rate(results.get(SHORT[short], {}), clients)
                if mine and other:
                    lines.append(f"{clients} clients: {label} {mine / other:.2f}x the output "
                                 f"tokens/s of {SHORT[short]}")
        one = (ours.get(1) or {}).get("itl_p99_ms")
        for clients in sorted(ours):
            p99 = (ours.get(clients) or {}).get("itl_p99_ms")
            if one and p99 and clients > 1:
                lines.append(f"{clients} clients: {label}'s p99 inter-token latency "
                             f"{p99 / one:.1f}x its single client's")
    return lines or ["(no continuous-batching figures in this run)"]


def table(results: dict[str, dict[int, dict]], args) -> str:
    head = ("| server | clients | requests (errors) | output tokens/s | TTFT p50 / p99 ms | "
            "ITL p50 / p99 ms |\n|---|---|---|---|---|---|")
    rows = []
    for name, points in results.items():
        for clients, r in points.items():
            if "error" in r:
                said = r["error"] or "stopped before it ended (no figures)"
                rows.append(f"| {name} | {clients} | {said} | | | |")
                continue
            errors = sum(r["errors"].values())
            rows.append(f"| {name} | {clients} | {r['requests']} ({errors}) | "
                        f"{r['output_tokens_per_s']:.1f} | {r['ttft_p50_ms']} / "
                        f"{r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} |")
    return head + "\n" + "\n".join(rows)


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in results.items():
        xs = [c for c, r in points.items() if "error" not in r]
        left.plot(xs, [points[c]["output_tokens_per_s"] for c in xs], marker="o", label=name)
        right.plot(xs, [points[c]["itl_p99_ms"] or 0 for c in xs], marker="o", label=name)
    for axis, label in ((left, "output tokens/s"), (right, "inter-token latency p99 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", default="32:1024")
    p.add_argument("--output", default="16:256")
    p.add_argument("--time-limit", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--servers", default="ours,ours-b1,genai,genai-engine,llama-cpp")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "serve-bench.md")
    p.add_argument("--merge", type=Path, default=None,
                   help="An earlier run's JSON: its servers kept, those measured now replaced.")
    args = p.parse_args(argv)
    known = servers(args.dir, args.threads)
    command = " ".join([".venv/bin/python -m tools.bench_serve",
                        *(sys.argv[1:] if argv is None else argv)])
    earlier = json.loads(args.merge.read_text()) if args.merge else {}
    commands = [*earlier.pop("commands", []), command]
    results = {name: {int(c): r for c, r in points.items()} for name, points in earlier.items()}
    for short in args.servers.split(","):
        name = SHORT[short]
        server, style = known[name]
        results[name] = bench_server(name, server, style, args)
        args.out.with_suffix(".json").write_text(json.dumps({**results, "commands": commands},
                                                            indent=1))
    from mha_onnx.profile.roofline import cpu_isa, cpu_name

    text = PAGE.format(date=time.strftime("%Y-%m-%d"), cpu=cpu_name(), isa=cpu_isa(),
                       cores=os.cpu_count(), command="\n    ".join(commands),
                       table=table(results, args),
                       ratios="\n".join(f"- {line}" for line in ratios(results)),
                       plot=args.out.with_suffix(".png").name)
    args.out.write_text(text)
    plot(results, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
