"""A tuned model's candidate two Ifs down: its weights in the main graph or in its branch.

``fuse --tune`` writes a chain of Ifs, one per candidate, each nested in the previous one's
else branch, so the third candidate runs two Ifs below the main graph. ONNX Runtime 1.31
prepacks a MatMul's constant weight only from the MatMul's own graph or the one right above
it; this times the base no-mask export alone against a three-candidate dispatching model
whose last candidate is that same export, with its weights in the main graph (shared, as
tune/rules.py kept them at first) and in the else graph right above its branch (tune.dispatch
now), timed in turn (the order swapped every round), 40 rounds, medians, 2 threads,
sleeping thread pools:

    .venv/bin/python -m tools.experiments.deep_branch
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

SHAPES = ((1, 128), (8, 128), (1, 512))  # (batch, length): the third rule's lengths


def main() -> None:
    from mha_onnx.config import load_preset
    from mha_onnx.export.mha import export_model
    from mha_onnx.runtime.ort import OrtRunner
    from mha_onnx.tune import rules as tune
    from mha_onnx.tune.dispatch import dispatch

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "none.onnx"
        export_model(load_preset("base").replace(mask="none"), path, force=True)
        original = onnx.load(path)
    models = {"a": original, "b": original, tune.ORIGINAL: original}
    rules = [tune.Rule(8, "a"), tune.Rule(12, "b"), tune.Rule(None, tune.ORIGINAL)]
    inside = dispatch(models, rules, "seq_q")
    in_main = onnx.ModelProto()
    in_main.CopyFrom(inside)
    nested = next(a.g for a in in_main.graph.node[-1].attribute if a.name == "else_branch")
    in_main.graph.initializer.extend(nested.initializer)  # (the names are unique)
    del nested.initializer[:]
    graphs = {"alone": original, "weights in the main graph": in_main,
              "weights in the graph above": inside}
    runners = {k: OrtRunner(m.SerializeToString(), "cpu", threads=2, spinning=False)
               for k, m in graphs.items()}
    name = original.graph.input[0].name
    print("| batch | length | alone ms | weights in the main graph | weights in the graph above |")
    print("|---|---|---|---|---|")
    for batch, length in SHAPES:
        feeds = {name: np.random.default_rng(0).standard_normal(
            (batch, length, 512)).astype(np.float32)}
        times: dict[str, list[float]] = {k: [] for k in runners}
        for round_ in range(40):
            order = list(runners.items())
            for key, run in order if round_ % 2 else order[::-1]:
                start = time.perf_counter()
                run.infer(feeds)
                times[key].append(time.perf_counter() - start)
        median = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
        alone = median["alone"]
        print(f"| {batch} | {length} | {alone:.2f} | "
              f"{median['weights in the main graph'] / alone:.2f}x | "
              f"{median['weights in the graph above'] / alone:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
