"""Our symbolic shape inference (mha_onnx/graph/symbolic) beside ONNX Runtime's public one,
file by file, in one process: how many values each gives a shape, how many of the values
both shape agree on every static dim and rank, and the time each takes.

    .venv/bin/python tools/bench_shapes.py tests/fixtures/optimum/*/*.onnx

ORT's is run as its users call it (``SymbolicShapeInference.infer_shapes(model,
auto_merge=True)``); where it raises, the row says so. Both run on the file as fuse sees it
(inputs' dims named by input_specs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _shapes(model) -> dict[str, list]:
    from mha_onnx.graph.walk import all_graphs

    return {v.name: [d.dim_value if d.HasField("dim_value") else "?"
                     for d in v.type.tensor_type.shape.dim]
            for g in all_graphs(model.graph) for v in [*g.value_info, *g.output]
            if v.type.tensor_type.HasField("shape")}


def _ort(model):
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        here = os.getcwd()
        os.chdir(tmp)  # (it saves sym_shape_infer_temp.onnx where it runs when it stops)
        try:
            return SymbolicShapeInference.infer_shapes(model, auto_merge=True)
        finally:
            os.chdir(here)


def row(path: str) -> list:
    import onnx

    from mha_onnx.graph.dims import with_related_dims
    from mha_onnx.graph.inputs import input_specs
    from mha_onnx.graph.symbolic import infer_shapes

    model = onnx.load(path)
    model = with_related_dims(model, input_specs(model))
    start = time.perf_counter()
    ours = _shapes(infer_shapes(model)[0])
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    try:
        theirs, failed = _shapes(_ort(model)), ""
    except Exception as exc:  # noqa: BLE001 - a row that says it
        theirs, failed = {}, f"raised {type(exc).__name__}"
    theirs_s = time.perf_counter() - start
    both = [n for n in ours if n in theirs]
    agree = sum(len(ours[n]) == len(theirs[n]) and all(
        a == b or "?" in (a, b) for a, b in zip(ours[n], theirs[n], strict=False))
        for n in both)
    return [path, len(ours), failed or len(theirs), f"{agree}/{len(both)}",
            f"{ours_s:.2f}", f"{theirs_s:.2f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    from mha_onnx.table import table

    rows = [row(f) for f in args.files]
    print(table(["file", "ours: values", "ORT: values", "agree", "ours s", "ORT s"],
                       rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
