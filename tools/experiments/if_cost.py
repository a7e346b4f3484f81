"""What a run-time If costs ONNX Runtime on the CPU, by how many outer-scope weights its
branches read (issue 21: a tuned model dispatching on the length pays it on every run).

A chain of N small MatMuls, plain and inside both branches of an If on the input's length
(the branches read the N weights from the outer scope), timed back to back, best of 5 x 500
runs, 1 thread:

    .venv/bin/python -m tools.experiments.if_cost
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

F = TensorProto.FLOAT


def _chain(n: int, prefix: str) -> tuple[list[onnx.NodeProto], str]:
    nodes, x = [], "x"
    for i in range(n):
        nodes.append(h.make_node("MatMul", [x, f"w{i}"], [f"{prefix}{i}"]))
        x = f"{prefix}{i}"
    nodes.append(h.make_node("Identity", [x], [f"{prefix}out"]))
    return nodes, f"{prefix}out"


def model(n: int, dispatch: bool) -> onnx.ModelProto:
    """N MatMuls over x [1, L, 4]; ``dispatch``: inside both branches of If(L < 128)."""
    inits = [nh.from_array(np.full((4, 4), 0.01, np.float32), f"w{i}") for i in range(n)]
    if dispatch:
        branches = []
        for prefix in ("t", "e"):
            nodes, out = _chain(n, prefix)
            branches.append(h.make_graph(nodes, prefix, [], [h.make_tensor_value_info(out, F, None)]))
        nodes = [h.make_node("Shape", ["x"], ["s"], start=1, end=2),
                 h.make_node("Squeeze", ["s"], ["length"]),
                 h.make_node("Less", ["length", "bound"], ["c"]),
                 h.make_node("If", ["c"], ["y"], then_branch=branches[0], else_branch=branches[1])]
        inits.append(nh.from_array(np.array(128, np.int64), "bound"))
    else:
        nodes, out = _chain(n, "m")
        nodes.append(h.make_node("Identity", [out], ["y"]))
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", F, [1, "L", 4])],
                         [h.make_tensor_value_info("y", F, None)], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=9)


def _best_us(session: ort.InferenceSession, x: np.ndarray) -> float:
    for _ in range(200):
        session.run(None, {"x": x})
    best = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(500):
            session.run(None, {"x": x})
        best.append((time.perf_counter() - start) / 500 * 1e6)
    return min(best)


def main() -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    x = np.ones((1, 16, 4), np.float32)
    print("| weights read | plain (us) | inside an If (us) | the If's cost (us) |")
    print("|---|---|---|---|")
    for n in (1, 10, 50, 200):
        times = [_best_us(ort.InferenceSession(model(n, d).SerializeToString(), options,
                                               providers=["CPUExecutionProvider"]), x)
                 for d in (False, True)]
        print(f"| {n} | {times[0]:.1f} | {times[1]:.1f} | {times[1] - times[0]:.1f} |")


if __name__ == "__main__":
    main()
