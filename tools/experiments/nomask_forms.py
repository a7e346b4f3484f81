"""Exact forms of the base no-mask layer at batch 1, L 2048 (issue 21's 1.3x bar): which
ORT CPU kernels could beat what `fuse` writes there.

The base preset's no-mask export (d_model 512, 8 heads of 64, fp32) and its fusion
(MultiHeadAttention, ORT's CPU flash path), next to forms built from the same weights:

- the Q/K/V biases given to MultiHeadAttention (its bias input) instead of three Adds;
- the three projections as one MatMul, split before the kernel;
- MultiHeadAttention with an all-zero attention_bias (ORT then takes its unfused path:
  whole score matrix, MLAS GEMMs, softmax in place);
- the scale folded into W_q and the plain MatMul, Softmax, MatMul (no scale pass).

Each session made once, timed in turn (one run of each per round, the order rotated every
round), median of the rounds, 2 threads, sleeping thread pools; outputs compared with the
original's:

    .venv/bin/python -m tools.experiments.nomask_forms [--seq-len 2048] [--rounds 15]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper as h
from onnx import numpy_helper as nh


def _weights(fused: onnx.ModelProto) -> dict[str, np.ndarray]:
    """W_q, W_k, W_v, W_o and biases of the fused no-mask graph, by role."""
    graph = fused.graph
    init = {i.name: nh.to_array(i) for i in graph.initializer}
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    adds = {n.input[0]: n.input[1] for n in graph.node if n.op_type == "Add"}
    out = {}
    for role, node in zip("qkvo", matmuls, strict=True):
        out[f"w{role}"] = init[node.input[1]]
        out[f"b{role}"] = init[adds[node.output[0]]]
    return out


def _forms(fused: onnx.ModelProto, heads: int) -> dict[str, onnx.ModelProto]:
    w = _weights(fused)
    x = fused.graph.input[0].name
    d = w["wq"].shape[0]
    size = d // heads
    mha = {"domain": "com.microsoft", "num_heads": heads, "scale": float(1 / np.sqrt(size))}

    def model(nodes, inits):
        nodes = nodes + [h.make_node("MatMul", ["attn", "wo"], ["o0"]),
                         h.make_node("Add", ["o0", "bo"], ["output"])]
        inits = {**inits, "wo": w["wo"], "bo": w["bo"]}
        graph = h.make_graph(nodes, "g", list(fused.graph.input), list(fused.graph.output),
                             [nh.from_array(v, k) for k, v in inits.items()])
        made = h.make_model(graph, opset_imports=list(fused.opset_import))
        made.ir_version = fused.ir_version
        return made

    def projections(biased: bool) -> list:
        nodes = []
        for r in "qkv":
            nodes.append(h.make_node("MatMul", [x, f"w{r}"], [f"{r}0" if biased else r]))
            if biased:
                nodes.append(h.make_node("Add", [f"{r}0", f"b{r}"], [r]))
        return nodes

    qkv = {k: w[k] for k in ("wq", "wk", "wv")}
    packed_bias = np.concatenate([w["bq"], w["bk"], w["bv"]])
    biased = {**qkv, "bq": w["bq"], "bk": w["bk"], "bv": w["bv"]}
    zero_bias = [h.make_node("Shape", [x], ["L"], start=1, end=2),
                 h.make_node("Concat", ["ones", "L", "L"], ["bias_shape"], axis=0),
                 h.make_node("ConstantOfShape", ["bias_shape"], ["zeros"],
                             value=nh.from_array(np.zeros(1, np.float32)))]
    scale = float(1 / np.sqrt(size))
    heads_first = []
    for r, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        heads_first += [h.make_node("Reshape", [r, "split_heads"], [f"{r}4"]),
                        h.make_node("Transpose", [f"{r}4"], [f"{r}t"], perm=perm)]
    return {
        "bias into MultiHeadAttention": model(
            projections(False) + [h.make_node("MultiHeadAttention", ["q", "k", "v", "b"],
                                              ["attn"], **mha)], {**qkv, "b": packed_bias}),
        "one projection MatMul, Split": model(
            [h.make_node("MatMul", [x, "wqkv"], ["p"]),
             h.make_node("Split", ["p"], ["q", "k", "v"], axis=2, num_outputs=3),
             h.make_node("MultiHeadAttention", ["q", "k", "v", "b"], ["attn"], **mha)],
            {"wqkv": np.concatenate([w["wq"], w["wk"], w["wv"]], 1), "b": packed_bias}),
        "MultiHeadAttention, zero attention_bias": model(
            projections(True) + zero_bias + [h.make_node(
                "MultiHeadAttention", ["q", "k", "v", "", "", "zeros"], ["attn"], **mha)],
            {**biased, "ones": np.array([1, 1], np.int64)}),
        "scale in W_q, MatMul Softmax MatMul": model(
            projections(True) + heads_first + [
                h.make_node("MatMul", ["qt", "kt"], ["scores"]),
                h.make_node("Softmax", ["scores"], ["probs"], axis=-1),
                h.make_node("MatMul", ["probs", "vt"], ["a0"]),
                h.make_node("Transpose", ["a0"], ["a1"], perm=[0, 2, 1, 3]),
                h.make_node("Reshape", ["a1", "merge_heads"], ["attn"])],
            {**biased, "wq": w["wq"] * scale, "bq": w["bq"] * scale,
             "split_heads": np.array([0, 0, heads, size], np.int64),
             "merge_heads": np.array([0, 0, d], np.int64)}),
    }


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> None:
    from mha_onnx.config import load_preset
    from mha_onnx.export.mha import export_model
    from mha_onnx.rewrite import fuse_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    config = load_preset("base")
    with tempfile.TemporaryDirectory() as folder:
        original, fused = Path(folder, "none.onnx"), Path(folder, "none.fused.onnx")
        export_model(config.replace(mask="none"), original, force=True)
        fuse_file(original, fused)
        models = {"original (export)": onnx.load(original), "fuse": onnx.load(fused)}
    models.update(_forms(models["fuse"], config.num_heads))
    data = np.random.default_rng(0).standard_normal((1, args.seq_len, config.d_model))
    feeds = {models["fuse"].graph.input[0].name: data.astype(np.float32)}
    sessions = {k: _session(m) for k, m in models.items()}
    want = sessions["original (export)"].run(None, feeds)[0]
    for label, session in sessions.items():
        err = float(np.abs(session.run(None, feeds)[0] - want).max())
        print(f"{label}: max abs vs the original {err:.1e}")
    labels = list(sessions)
    times: dict[str, list[float]] = {k: [] for k in labels}
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            start = time.perf_counter()
            sessions[label].run(None, feeds)
            times[label].append(time.perf_counter() - start)
    base = float(np.median(times["original (export)"]))
    print(f"\nbatch 1, L {args.seq_len}, 2 threads, median of {args.rounds} rounds")
    print("| form | ms | original / form |\n|---|---|---|")
    for label in labels:
        t = float(np.median(times[label]))
        print(f"| {label} | {1e3 * t:.1f} | {base / t:.2f}x |")


if __name__ == "__main__":
    main()
