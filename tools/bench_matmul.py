"""One MatMul in each of `mha-onnx quantize`'s forms as the rows grow: what a batched decode
step or a prompt chunk pays per weight. The forms: float32 MatMul, MatMulNBits int4 and int8
(block 32, accuracy level 4: the int4/int8 defaults) and w8a8 (int8 weights per column, int8
activations per row, MatMulIntegerToFloat), each made by `quantize_weights` from one random
[K, N] weight, timed in interleaved rounds in one process (no spinning threads, so that the
idle sessions do not take the cores from the timed one).

    .venv/bin/python -m tools.bench_matmul [--k 1024] [--n 5632] [--rows 1,4,16,64,256]
        [--rounds 7] [--threads 2]

Prints a markdown table: the median milliseconds per product, and each form's time over
w8a8's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def _sessions(k: int, n: int, threads: int) -> dict:
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from mha_onnx.quantize.weights import QuantizeConfig, quantize_weights

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="product")], "one",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["rows", n])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    forms = {"float32": model}
    for weights in ("int4", "int8", "w8a8"):
        forms[weights] = quantize_weights(model, QuantizeConfig(weights=weights)).model
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return {name: ort.InferenceSession(m.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
            for name, m in forms.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=5632)
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    sessions = _sessions(args.k, args.n, args.threads)
    rng = np.random.default_rng(1)
    names = list(sessions)
    print(f"`python -m tools.bench_matmul {' '.join(sys.argv[1:] if argv is None else argv)}`"
          f"\n\nms per product of [rows, {args.k}] x [{args.k}, {args.n}] (median of "
          f"{args.rounds} rounds; in brackets: over w8a8's)\n")
    print("| rows | " + " | ".join(names) + " |\n" + "|---" * (len(names) + 1) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((rows, args.k)).astype(np.float32)
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                session = sessions[name]
                session.run(None, {"x": x})
                started = time.perf_counter()
                for _ in range(10):
                    session.run(None, {"x": x})
                times[name].append((time.perf_counter() - started) / 10 * 1e3)
        median = {name: statistics.median(t) for name, t in times.items()}
        print(f"| {rows} | " + " | ".join(
            f"{median[name]:.3f} ({median[name] / median['w8a8']:.2f}x)" for name in names)
            + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
