"""Where `mha-onnx export --model` spends its time and memory: the export runs in this
process, and at each of its progress lines (torch.export, fuse, validate, ...) the stage
that ended is written with its seconds and its peak resident memory, beside the bytes of the
folder's weights. The memory is that of the process and its children together (ORT first
meets each model in a child process), sampled every 20 ms: what the machine must hold.

    .venv/bin/python -m tools.bench_export HF_FOLDER [-o OUT.onnx] [--kv-cache shared]
        [--weights float|int4|w8a8] [--json FILE]

Prints a markdown table; the last row is the whole export (the peak over every stage). The
start-up row is the imports' memory (torch, transformers, onnxruntime), which does not grow
with the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def _weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir()
               if p.suffix in (".safetensors", ".bin") and p.is_file())


_SAMPLER = r"""
import os, select, sys, time
from pathlib import Path
import psutil
me, peak = psutil.Process(int(sys.argv[1])), [0, 0]
def now():
    rss = anon = 0
    try:
        tree = [p for p in [me, *me.children(recursive=True)] if p.pid != os.getpid()]
    except psutil.NoSuchProcess:
        sys.exit(0)
    for process in tree:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text().splitlines()
        except OSError:  # (a child that ended between the listing and the read)
            continue
        fields = {k: v for k, _, v in (line.partition(":") for line in status)}
        rss += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
        anon += int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
    return rss, anon
while True:
    rss, anon = now()
    peak = [max(peak[0], rss), max(peak[1], anon)]
    if select.select([sys.stdin], [], [], 0.02)[0]:
        if not sys.stdin.readline():
            break
        print(peak[0], peak[1], flush=True)
        peak = list(now())
"""


class _Sampler:
    """The resident memory of this process and its children every 20 ms, all of it (RSS:
    file pages mapped included, which the kernel may drop and read again) and the anonymous
    part (RssAnon: what the machine must hold); the peaks since the last ``take``. It reads
    from a process of its own: a thread here waits for the interpreter's lock, which a
    protobuf encoding or an ORT call holds for seconds, and would miss what peaks then."""

    def __init__(self) -> None:
        import os
        import subprocess

        self.child = subprocess.Popen([sys.executable, "-c", _SAMPLER, str(os.getpid())],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def take(self) -> tuple[int, int]:
        self.child.stdin.write("take\n")
        self.child.stdin.flush()
        rss, anon = self.child.stdout.readline().split()
        return int(rss), int(anon)

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("-o", "--output", type=Path)
    p.add_argument("--kv-cache", default="appended", choices=("appended", "shared"))
    p.add_argument("--weights", default="float", choices=("float", "int4", "int8", "w8a8"))
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import mha_onnx.export.hf as hf
    from mha_onnx.export.options import HfExportConfig

    sampler = _Sampler()

    stages: list[dict] = []
    state = {"name": "start-up (imports)", "t": time.perf_counter()}

    def progress(line: str) -> None:
        now = time.perf_counter()
        rss, anon = sampler.take()
        stages.append({"stage": state["name"], "seconds": round(now - state["t"], 1),
                       "peak_rss": rss, "peak_anon": anon})
        print(f"[{now - started:7.1f} s] {line}", file=sys.stderr, flush=True)
        state.update(name=line, t=time.perf_counter())

    started = time.perf_counter()
    weights = _weights_bytes(args.folder)
    with tempfile.TemporaryDirectory(prefix="bench_export_") as tmp:
        out = args.output or Path(tmp) / "model.onnx"
        cfg = HfExportConfig(kv_cache=args.kv_cache, weights=args.weights, force=True,
                             genai=False)
        progress("loading")
        hf.export_hf(args.folder, out, cfg, progress=progress)
        progress("done")
    sampler.close()
    whole = max(s["peak_rss"] for s in stages)
    anon = max(s["peak_anon"] for s in stages)
    total = time.perf_counter() - started
    command = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"`python -m tools.bench_export {command}`\n\nweights {weights / 2**20:,.0f} MiB\n")
    print("| stage | s | peak RSS MiB | / weights | peak anonymous MiB | / weights |\n"
          "|---|---|---|---|---|---|")
    for s in stages:
        print(f"| {s['stage'][:60]} | {s['seconds']} | {s['peak_rss'] / 2**20:,.0f} | "
              f"{s['peak_rss'] / weights:.2f}x | {s['peak_anon'] / 2**20:,.0f} | "
              f"{s['peak_anon'] / weights:.2f}x |")
    print(f"| **whole export** | {total:.1f} | {whole / 2**20:,.0f} | {whole / weights:.2f}x | "
          f"{anon / 2**20:,.0f} | {anon / weights:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "weights": weights,
                                         "seconds": total, "peak_rss": whole,
                                         "peak_anon": anon,
                                         "stages": stages},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
