"""A GPT-Neo prompt through ``fuse --kv-cache shared`` against the original, unpadded and
left-padded: what computing the left-padded queries from the mask's rows costs (GPT-Neo's
two mask terms, lower/rows.py ``_unseen_queries``).

    .venv-optimum/bin/python -m tools.experiments.two_term_prompt make DIR
    .venv/bin/python -m tools.experiments.two_term_prompt run DIR

The model: Optimum 0.1.0's export of GPTNeoForCausalLM (hidden 512, 8 heads, 2 layers,
global + local with window 256, random weights); ``run`` fuses it (verified) and times the
two models in turn, 7 runs each, median ms, 2 intra-op threads. Left padding: each row's
first 1..L/2 positions (random, seed 0).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

CONFIG = {"vocab_size": 128, "hidden_size": 512, "num_layers": 2, "num_heads": 8,
          "attention_types": [[["global", "local"], 1]], "window_size": 256,
          "max_position_embeddings": 2048}
POINTS = [(1, 128), (8, 128), (8, 512), (4, 1024)]


def make(folder: Path) -> None:
    from tools.optimum_fixtures import optimum_export

    optimum_export("text-generation-with-past", "GPTNeoConfig", "GPTNeoForCausalLM", CONFIG,
                   folder)


def _feeds(session, batch: int, length: int, padded: bool, buffer: int, rng):
    ids = rng.integers(0, 120, (batch, length)).astype(np.int64)
    mask = np.ones((batch, length), np.int64)
    if padded:
        for row in range(batch):
            mask[row, :rng.integers(1, length // 2)] = 0
    feeds = {"input_ids": ids, "attention_mask": mask,
             "position_ids": np.clip(np.cumsum(mask, 1) - 1, 0, None).astype(np.int64)}
    for spec in session.get_inputs():
        if spec.name.startswith("past"):
            feeds[spec.name] = np.zeros((batch, spec.shape[1], buffer, spec.shape[3]), np.float32)
    return feeds


def run(folder: Path) -> None:
    import onnxruntime as ort

    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.policy import FormPolicy

    fused = folder / "shared.onnx"
    if not fused.exists():
        fuse_file(folder / "model.onnx", fused, policy=FormPolicy(kv_cache="shared"))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    original, shared = (ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"])
                        for p in (folder / "model.onnx", fused))
    rng = np.random.default_rng(0)
    print("| batch | L | padding | original ms | shared fused ms | fused / original |")
    print("|---|---|---|---|---|---|")
    for batch, length in POINTS:
        for padded in (False, True):
            state = rng.bit_generator.state
            plain = _feeds(original, batch, length, padded, 0, rng)
            rng.bit_generator.state = state
            buffers = _feeds(shared, batch, length, padded, length + 8, rng)
            times: dict[str, list[float]] = {"o": [], "f": []}
            for _ in range(7):
                for key, session, feeds in (("o", original, plain), ("f", shared, buffers)):
                    start = time.perf_counter()
                    session.run(["logits"], feeds)
                    times[key].append(time.perf_counter() - start)
            o, f = (float(np.median(times[k])) * 1e3 for k in "of")
            print(f"| {batch} | {length} | {'left' if padded else 'none'} | {o:.1f} | {f:.1f} "
                  f"| {f / o:.2f} |")


if __name__ == "__main__":
    (make if sys.argv[1] == "make" else run)(Path(sys.argv[2]))
