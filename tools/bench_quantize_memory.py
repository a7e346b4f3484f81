"""What `mha-onnx quantize` holds in memory: the quantization runs in this process (as the CLI
runs it: int4 RTN, its accuracy measured, the sensitivity ranking unless --no-sensitivity),
and its peak resident memory, this process and its children together sampled every 20 ms
(tools/bench_export.py's sampler), is printed beside the float model's bytes and the time.

    .venv/bin/python -m tools.bench_quantize_memory MODEL.onnx [--no-sensitivity] [--json FILE]

The anonymous part (RssAnon) is what the machine must hold; RSS also counts the model's
file pages that ONNX Runtime maps, which the kernel may drop and read again.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tools.bench_export import _Sampler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--no-sensitivity", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from mha_onnx.quantize.config import QuantizeConfig
    from mha_onnx.quantize.run import quantize_file

    sampler = _Sampler()
    sampler.take()  # (the imports' peak left out)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_quantize_") as tmp:
        report = quantize_file(args.model, Path(tmp) / "model.onnx", QuantizeConfig(),
                               sensitivity=not args.no_sensitivity, force=True)
        seconds = time.perf_counter() - started
        rss, anon = sampler.take()
    sampler.close()
    weights = report.sizes[0]
    command = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"`python -m tools.bench_quantize_memory {command}`\n")
    print("| float model MiB | written | s | peak RSS MiB | / model | peak anonymous MiB | "
          "/ model |\n|---|---|---|---|---|---|---|")
    print(f"| {weights / 2**20:,.0f} | {report.written} | {seconds:.1f} | {rss / 2**20:,.0f} | "
          f"{rss / weights:.2f}x | {anon / 2**20:,.0f} | {anon / weights:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "model_bytes": weights,
                                         "seconds": seconds, "peak_rss": rss,
                                         "peak_anon": anon, "written": report.written},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
