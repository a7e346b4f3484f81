"""What every benchmark suite shares (``python -m tools.benchmark SUITE``): the common
options, quiet logs, a scratch folder, the line that says what was measured with which
command on which machine, and where the table goes. A suite is a module with
``main(argv) -> int`` that measures with ``mha_onnx.profile`` (timed in turn, sleeping
thread pools) and renders its own table."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import shlex
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

# name -> (module, what it measures); the modules also run alone (python -m tools.bench_kv)
SUITES = {
    "attention": ("tools.bench", "each attention variant against its peers (base preset, "
                  "batch 1): unfused, onnxscript, ONNX Attention, PyTorch, roofline"),
    "decoders": ("tools.bench_decoders", "decoder layers (own causal, nn.MHA, GPT-2, Llama, "
                 "T5-like, BLOOM) fused vs unfused, time and memory"),
    "kv": ("tools.bench_kv", "KV-cache decode steps of a HF layer: unfused, appended, shared"),
    "forms": ("tools.fusion_forms", "every fused form ORT offers, per attention variant"),
    "grid": ("tools.grid", "fused / unfused over batch x length x threads"),
    "tune": ("tools.bench_tune", "fuse --tune against the untuned fusion and the original"),
    "optimum": ("tools.bench_optimum", "an Optimum Llama export: fused, ORT's optimizer, ORT "
                "GenAI's builder (three environments)"),
    "quantize": ("tools.bench_quantize", "mha-onnx quantize int4/int8 vs the float fusion vs "
                 "ORT GenAI's int4 graph: size, prompt, decode step, accuracy"),
    "generate": ("tools.bench_generate", "tokens/s and first-token time: mha-onnx generate vs "
                 "ORT GenAI's generator (same graph, GenAI's graph) vs transformers"),
}


def ints(text: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> (1, 8, 32)."""
    return tuple(int(x) for x in text.split(",") if x)


def parser(doc: str | None, *, threads: int | tuple[int, ...] = 2,
           min_time: float | None = 1.0, out: bool = True,
           json_out: bool = False) -> argparse.ArgumentParser:
    """A suite's parser with the common options: --threads (one count, or a list where the
    default is a tuple), --min-time (seconds per model per point), --out (the markdown
    table), --json (every point)."""
    first = (doc or "").strip().splitlines()
    made = argparse.ArgumentParser(description=first[0] if first else None)
    if isinstance(threads, tuple):
        made.add_argument("--threads", type=ints, default=threads)
    else:
        made.add_argument("--threads", type=int, default=threads)
    made.add_argument("--min-time", type=float, default=min_time,
                      help="at least this long per model per point (s)")
    if out:
        made.add_argument("--out", default=None, help="write the markdown table here")
    if json_out:
        made.add_argument("--json", dest="json_path", default=None,
                          help="write every point as JSON here")
    return made


def quiet() -> None:
    """Only errors from the libraries a suite drives (fusing prints notes per block)."""
    logging.basicConfig(level=logging.ERROR)
    for noisy in ("onnxscript", "onnx_ir", "torch", "mha_onnx"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")


def command(suite: str, argv: list[str] | None) -> str:
    """The command line that reproduces this run, as the docs quote it."""
    args = sys.argv[1:] if argv is None else argv
    return f".venv/bin/python -m tools.benchmark {suite} {shlex.join(args)}".rstrip()


def measured(cmd: str, details: str) -> str:
    """The first line of every table: when, with what, on which machine, and how."""
    from mha_onnx.profile.roofline import cpu_isa, cpu_name

    isa = f" ({cpu_isa()})" if cpu_isa() else ""
    return (f"Measured {datetime.date.today()} with `{cmd}` on {cpu_name()}{isa}, "
            f"{os.cpu_count()} CPUs ({details}).")


@contextlib.contextmanager
def scratch(suite: str) -> Iterator[Path]:
    """A folder for the graphs a suite builds, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"mha_{suite}_") as folder:
        yield Path(folder)


def emit(lines: list[str], out: str | None = None, json_path: str | None = None,
         records: object = None) -> None:
    """Print the table; write it to ``out`` and ``records`` to ``json_path`` if given."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps(records, indent=1))
