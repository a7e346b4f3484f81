"""What a fused decoder's run-time guards cost a decode step, and where (issue 41).

A model fused with ``--kv-cache shared`` runs each layer's attention inside an ``If`` (the
fast GroupQueryAttention form, or the exact general form when the guard says the inputs
need it) and computes the guard once per step in the main graph. ORT GenAI's graph has
neither. This times three graphs made from one fusion (timing only: the second and third
are not exact for every input) against GenAI's graph of the same weights, one decode step
at a given context, batch 1, every graph in one process, timed in turn, the order rotated
every round, medians of the rounds, 2 threads, sleeping thread pools:

- as written;
- Ifs inlined: every If of the main graph replaced by its then branch (the guards are
  still computed, nothing reads them);
- no guards: the same, with the nodes nothing reads removed (GenAI's graph's work);

``--also`` times more fusions of the same weights as written beside them; and, with
``--memory``, each graph's session memory (resident set growth while the session is made,
each in a process of its own):

    .venv/bin/python -m tools.experiments.guard_cost FUSED.onnx --genai GENAI.onnx --memory
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from mha_onnx.generate.decode import inline_ifs, without_unread

_RSS = """
import sys, onnxruntime as ort
def rss():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS'))
before = rss()
ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])
print((rss() - before) / 1024)
"""


def _memory(path: Path) -> float:
    done = subprocess.run([sys.executable, "-c", _RSS, str(path)], capture_output=True,
                          text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from mha_onnx.runtime.ort import OrtRunner
    from tools.bench_optimum_run import _feeds, _step, _time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fused", type=Path)
    parser.add_argument("--genai", type=Path, help="ORT GenAI's graph of the same weights")
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="another fusion of the same weights, timed as written beside "
                             "them (e.g. the same export fused by an earlier commit)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--spinning", action="store_true",
                        help="pool threads spin within a run (stopped after it), as generate runs")
    args = parser.parse_args()
    written = onnx.load(args.fused)
    inlined = inline_ifs(written)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"as written": args.fused}
        paths.update({f"as written: {path}": path for path in args.also})
        for label, model in (("Ifs inlined", inlined), ("no guards", without_unread(inlined))):
            paths[label] = Path(tmp) / f"{label.replace(' ', '_')}.onnx"
            onnx.save(model, paths[label])
        if args.genai:
            paths["ORT GenAI builder"] = args.genai
        runs, kernels = {}, {}
        for label, path in paths.items():
            kind = "genai" if label.startswith("ORT GenAI") else "shared"
            runner = OrtRunner(str(path), threads=2, spinning=args.spinning,
                               stop_spinning=args.spinning)
            feeds, past = _feeds(kind, runner.input_names, 1, 1, args.context,
                                 np.random.default_rng(0))
            runs[label] = _step(runner, kind, feeds, past)[0]
            kernels[label] = len(onnx.load(path, load_external_data=False).graph.node)
        times: dict[str, list[float]] = {label: [] for label in runs}
        labels = list(runs)
        for r in range(args.rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for label, ms in _time({k: runs[k] for k in order}, 1.0).items():
                times[label].append(ms)
        memory = {label: _memory(path) for label, path in paths.items()} if args.memory else {}
    last = labels[-1]
    base = statistics.median(times[last])
    print(f"| graph | main-graph nodes | step ms (median of {args.rounds}) | vs {last} |"
          + (" session MB |" if memory else ""))
    print("|---|---|---|---|" + ("---|" if memory else ""))
    for label in labels:
        ms = statistics.median(times[label])
        print(f"| {label} | {kernels[label]} | {ms:.3f} | {ms / base:.3f}x |"
              + (f" {memory[label]:.0f} |" if memory else ""))


if __name__ == "__main__":
    main()
