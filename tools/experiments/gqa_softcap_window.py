"""ORT's CPU GroupQueryAttention with ``softcap`` and ``local_window_size`` on a right-padded
row: which query positions agree with attention computed in numpy (why lower/rows.py sends a
padded prompt longer than the window to the capped general form).

    .venv/bin/python -m tools.experiments.gqa_softcap_window [WINDOW]   (default 8)

Batch 2, 13 positions, 4 query heads / 2 K/V heads of 8; row 1 keeps its first 8 keys
(``seqlens_k`` 7). The reference: query i reads key j when j <= i, j > i - WINDOW and j is
kept (the original's mask over positions), scores capped c·tanh(s/c) first. Prints, for a
cap of 0 (none) and 2, the largest difference over the kept queries and at each padded one.
"""
import sys

import numpy as np
from onnx import TensorProto as TP
from onnx import helper

from mha_onnx.runtime.ort import OrtRunner

B, S, H, G, D, KEPT = 2, 13, 4, 2, 8, 8


def gqa(window: int, cap: float) -> OrtRunner:
    attrs = {"num_heads": H, "kv_num_heads": G, "scale": 1 / np.sqrt(D),
             "local_window_size": window}
    if cap:
        attrs["softcap"] = cap
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens", "total"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", **attrs)
    inputs = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info("seqlens", TP.INT32, [B]),
               helper.make_tensor_value_info("total", TP.INT32, [])]
    outputs = [helper.make_tensor_value_info(n, TP.FLOAT, None)
               for n in ("out", "present_k", "present_v")]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 18),
                                             helper.make_opsetid("com.microsoft", 1)])
    return OrtRunner(model.SerializeToString(), "cpu")


def reference(q, k, v, window: int, cap: float) -> np.ndarray:
    q4 = q.reshape(B, S, H, D).transpose(0, 2, 1, 3)
    k4, v4 = (np.repeat(x.reshape(B, S, G, D).transpose(0, 2, 1, 3), H // G, axis=1)
              for x in (k, v))
    scores = q4 @ k4.transpose(0, 1, 3, 2) / np.sqrt(D)
    if cap:
        scores = cap * np.tanh(scores / cap)
    i, j = np.arange(S)[:, None], np.arange(S)[None]
    kept = np.ones((B, 1, 1, S), bool)
    kept[1, ..., KEPT:] = False
    scores = np.where((j <= i) & (j > i - window) & kept, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True) @ v4).transpose(0, 2, 1, 3).reshape(B, S, H * D)


def main(argv: list[str]) -> int:
    window = int(argv[0]) if argv else 8
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((B, S, H * D)) * 3).astype(np.float32)
    k = (rng.standard_normal((B, S, G * D)) * 3).astype(np.float32)
    v = rng.standard_normal((B, S, G * D)).astype(np.float32)
    feeds = {"q": q, "k": k, "v": v, "seqlens": np.array([S - 1, KEPT - 1], np.int32),
             "total": np.array(S, np.int32)}
    for cap in (0.0, 2.0):
        got = gqa(window, cap).infer(feeds)["out"]
        want = reference(q, k, v, window, cap)
        diff = np.abs(got - want).max(axis=-1)
        padded = ", ".join(f"{d:.3f}" for d in diff[1, KEPT:])
        print(f"window {window}, cap {cap:g}: kept queries {max(diff[0].max(), diff[1, :KEPT].max()):.2e}; "
              f"padded queries of row 1: {padded}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
