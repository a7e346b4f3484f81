"""ONNX Runtime's SkipLayerNormalization fusion against the two ops it replaces, on the CPU.

ORT fuses ``Add -> LayerNormalization`` into ``com.microsoft.SkipLayerNormalization``
wherever both operands of the Add have one known 3-D shape. This times that (the graph
``Add + LayerNormalization`` at the default optimisation level, which ORT fuses) against
``Sum + LayerNormalization`` (which it leaves), and the same for the RMS norm's
SkipSimplifiedLayerNormalization against Add + SimplifiedLayerNormalization: one graph per
variant, timed in turn, medians of 7 rounds, sleeping thread pools:

    .venv/bin/python -m tools.experiments.skip_norm [--threads 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

SHAPES = ((1, 1, 768), (8, 1, 1024), (1, 16, 768), (1, 128, 768), (8, 128, 768),
          (1, 512, 768), (1, 1024, 1024), (32, 512, 768))
TYPES = {"float32": (TensorProto.FLOAT, np.float32), "float16": (TensorProto.FLOAT16, np.float16)}


def model(residual: str, norm: str, hidden: int, dtype: str) -> onnx.ModelProto:
    """y = norm(residual(x, s)); ``norm`` LayerNormalization or (com.microsoft)
    SimplifiedLayerNormalization, ``residual`` Add or Sum; or, ``residual`` "Skip", the
    SkipSimplifiedLayerNormalization kernel written out (as rewrite/tighten/norms.py does)."""
    elem, np_type = TYPES[dtype]
    inputs = [h.make_tensor_value_info(n, elem, ["B", "S", hidden]) for n in ("x", "s")]
    weights = [nh.from_array(np.ones(hidden, np_type), "g"),
               nh.from_array(np.zeros(hidden, np_type), "b")]
    normed = (h.make_node("LayerNormalization", ["a", "g", "b"], ["y"], axis=-1, epsilon=1e-5)
              if norm == "LayerNormalization" else
              h.make_node("SimplifiedLayerNormalization", ["a", "g"], ["y"], axis=-1,
                          epsilon=1e-5))
    nodes = [h.make_node(residual, ["x", "s"], ["a"]), normed]
    if residual == "Skip":
        nodes = [h.make_node("SkipSimplifiedLayerNormalization", ["x", "s", "g"], ["y"],
                             domain="com.microsoft", epsilon=1e-5)]
    graph = h.make_graph(nodes, "g", inputs,
                         [h.make_tensor_value_info("y", elem, None)],
                         weights if norm == "LayerNormalization" else weights[:1])
    out = h.make_model(graph, opset_imports=[h.make_opsetid("", 18),
                                              h.make_opsetid("com.microsoft", 1)])
    out.ir_version = 9
    return out


def session(proto: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(proto.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def fused_ops(proto: onnx.ModelProto) -> list[str]:
    """The ops ORT runs for ``proto`` at its default level (is the Add fused away?)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        ort.InferenceSession(proto.SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
        return [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(TYPES), default="float32")
    args = parser.parse_args()
    variants = [("Add", "LayerNormalization"), ("Sum", "LayerNormalization"),
                ("Add", "SimplifiedLayerNormalization"), ("Sum", "SimplifiedLayerNormalization"),
                ("Skip", "SimplifiedLayerNormalization")]
    print(f"ORT {ort.__version__}, {args.threads} threads, {args.dtype}; ms per run (ops ORT ran)")
    rng = np.random.default_rng(0)
    for batch, length, hidden in SHAPES:
        protos = {v: model(*v, hidden, args.dtype) for v in variants}
        sessions = {v: session(p, args.threads) for v, p in protos.items()}
        feeds = {n: rng.standard_normal((batch, length, hidden)).astype(TYPES[args.dtype][1])
                 for n in ("x", "s")}
        runs = max(3, int(4e6 / (batch * length * hidden)))
        times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
        for _ in range(7):
            for v, s in sessions.items():
                s.run(None, feeds)
                start = time.perf_counter()
                for _ in range(runs):
                    s.run(None, feeds)
                times[v].append((time.perf_counter() - start) / runs * 1000)
        cells = [f"{'+'.join(fused_ops(protos[v]))} {np.median(times[v]):.4f}" for v in variants]
        print(f"[{batch}, {length}, {hidden}]  " + "  |  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
