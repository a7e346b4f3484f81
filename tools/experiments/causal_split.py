"""Causal attention faster than GroupQueryAttention? Ideas timed against it at one length.

    .venv/bin/python -m tools.experiments.causal_split [L]      (default 4096; base preset sizes, batch 1)

Plain MHA without a mask is the yardstick (the goal: causal at <= 0.6x of it). Candidates,
all exact (their output is checked against GQA's): GQA causal (the default form); the
queries split into K blocks, each attending to the keys up to its end with MHA and a bias
that is causal on its diagonal part only (work ~ (1 + 1/K)/2 of plain); two chunks with GQA,
the second taking the first's keys as past. All sessions timed in turn (2 threads, idle
pools sleeping), median of >= 8 s each.
"""
import sys
import time

import numpy as np
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from mha_onnx.runtime.ort import OrtRunner

H, D = 8, 64
HD = H * D
MS = "com.microsoft"


def vi(name: str, shape: list) -> object:
    return helper.make_tensor_value_info(name, TP.FLOAT, shape)


def const(name: str, array) -> object:
    return numpy_helper.from_array(np.asarray(array), name)


def model(n: int, nodes: list, inits: tuple = ()):
    graph = helper.make_graph(nodes, "g", [vi(x, [1, n, HD]) for x in "qkv"], [vi("o", [1, n, HD])],
                              list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid(MS, 1)], ir_version=9)


def plain(n: int):
    return model(n, [helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain=MS,
                                      num_heads=H)])


def gqa(n: int):
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "sl", "tot"],
                            ["o", "pk", "pv"], domain=MS, num_heads=H, kv_num_heads=H)
    return model(n, [node], (const("sl", np.array([n - 1], np.int32)),
                             const("tot", np.array(n, np.int32))))


def blocks(n: int, k: int):
    """Query block b attends keys [0, end of b) with MHA; only its diagonal part is masked."""
    size, nodes, inits, outs = n // k, [], [], []
    for b in range(k):
        end = (b + 1) * size
        inits += [const(f"s{b}", [b * size]), const(f"e{b}", [end]), const(f"z{b}", [0]),
                  const(f"ax{b}", [1])]
        nodes += [helper.make_node("Slice", ["q", f"s{b}", f"e{b}", f"ax{b}"], [f"q{b}"]),
                  helper.make_node("Slice", ["k", f"z{b}", f"e{b}", f"ax{b}"], [f"k{b}"]),
                  helper.make_node("Slice", ["v", f"z{b}", f"e{b}", f"ax{b}"], [f"v{b}"])]
        rows, cols = np.arange(b * size, end)[:, None], np.arange(end)[None, :]
        bias = np.where(cols <= rows, 0, -np.inf).astype(np.float32)[None, None]
        inits.append(const(f"bias{b}", bias))
        nodes.append(helper.make_node("MultiHeadAttention", [f"q{b}", f"k{b}", f"v{b}", "", "",
                                                             f"bias{b}"], [f"o{b}"], domain=MS,
                                      num_heads=H))
        outs.append(f"o{b}")
    nodes.append(helper.make_node("Concat", outs, ["o"], axis=1))
    return model(n, nodes, tuple(inits))


def two_chunks(n: int):
    """GQA on the first half; GQA on the second with the first half's keys as past."""
    h = n // 2
    inits = (const("a", [0]), const("m", [h]), const("e", [n]), const("ax", [1]),
             const("sl1", np.array([h - 1], np.int32)), const("t1", np.array(h, np.int32)),
             const("sl2", np.array([n - 1], np.int32)), const("t2", np.array(n, np.int32)),
             const("shape", [1, h, H, D]))
    nodes = [helper.make_node("Slice", [x, "a", "m", "ax"], [x + "1"]) for x in "qkv"]
    nodes += [helper.make_node("Slice", [x, "m", "e", "ax"], [x + "2"]) for x in "qkv"]
    nodes += [helper.make_node("GroupQueryAttention", ["q1", "k1", "v1", "", "", "sl1", "t1"],
                               ["o1", "pk1", "pv1"], domain=MS, num_heads=H, kv_num_heads=H)]
    for x in "kv":  # past in [B, H, T, D]
        nodes += [helper.make_node("Reshape", [x + "1", "shape"], [x + "1r"]),
                  helper.make_node("Transpose", [x + "1r"], ["p" + x], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("GroupQueryAttention", ["q2", "k2", "v2", "pk", "pv", "sl2", "t2"],
                               ["o2", "pk2", "pv2"], domain=MS, num_heads=H, kv_num_heads=H),
              helper.make_node("Concat", ["o1", "o2"], ["o"], axis=1)]
    return model(n, nodes, inits)


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 4096
    graphs = {"plain MHA (no mask)": plain(n), "GQA causal": gqa(n)}
    graphs.update({f"query blocks K={k} (MHA + diagonal bias)": blocks(n, k) for k in (2, 4, 8, 16)})
    graphs["2 chunks, GQA with past"] = two_chunks(n)
    sessions = {k: OrtRunner(m.SerializeToString(), threads=2, spinning=False).session
                for k, m in graphs.items()}  # timed in turn: idle pools sleep
    rng = np.random.default_rng(0)
    feeds = {x: rng.standard_normal((1, n, HD)).astype(np.float32) for x in "qkv"}
    want = sessions["GQA causal"].run(["o"], feeds)[0]
    for name, session in sessions.items():
        if not name.startswith("plain"):
            diff = float(np.abs(session.run(["o"], feeds)[0] - want).max())
            assert diff < 1e-4, (name, diff)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    end = time.time() + 8 * len(sessions)
    while time.time() < end:
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(["o"], feeds)
            times[name].append(time.perf_counter() - start)
    base = float(np.median(times["plain MHA (no mask)"]))
    print(f"L={n}, batch 1, {H} heads of {D}, 2 threads")
    print("| form | p50 ms | / plain |\n|---|---|---|")
    for name, runs in times.items():
        print(f"| {name} | {1e3 * np.median(runs):.1f} | {np.median(runs) / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
