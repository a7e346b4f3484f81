"""A GGUF file's perplexity through llama.cpp (llama-cpp-python, in ``.venv-llama``: ``make
bench-envs``) over token windows, as tools/quantize_trained.py measures its ONNX files:
exp(mean next-token cross-entropy) within each window, no BOS added.

    .venv-llama/bin/python -m tools.gguf_perplexity MODEL.gguf WINDOWS.json

Prints {"perplexity": ..., "windows": ..., "tokens": ...} as JSON.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np

from tools.train_fixture import target_log_probs


def perplexity(path: str, windows: list[list[int]]) -> float:
    import llama_cpp

    longest = max(len(w) for w in windows)
    llm = llama_cpp.Llama(model_path=path, n_ctx=max(64, longest), logits_all=True,
                          verbose=False, n_threads=2)
    total, count = 0.0, 0
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = np.array(llm.scores[:len(window)])[:-1]
        total -= target_log_probs(logits, window[1:]).sum()
        count += len(window) - 1
    return math.exp(total / count)


def main() -> None:
    path, windows_file = sys.argv[1], sys.argv[2]
    with open(windows_file) as handle:
        windows = json.load(handle)
    print(json.dumps({"perplexity": perplexity(path, windows), "windows": len(windows),
                      "tokens": sum(len(w) for w in windows)}))


if __name__ == "__main__":
    main()
