"""A prompt's rotation inside GroupQueryAttention against the exporter's rotation before it
(issue 20: is folding the rotation into a prompt's kernel worth it?).

The small graph of tests/rewrite/test_rotary.py (Hugging Face's rotation of Q and K, then
GroupQueryAttention without a past) at head size 64, as exported and after rotary.fold_rotary
(the prompt's positions counted up from 0: the folded branch runs), timed alternately (the
order swapped every round), median of each, 2 threads, sleeping thread pools. ``--spellings``
also times the other rotations the fold takes (GPT-J's: interleaved, partial, before the
heads' transpose; GPT-NeoX's: partial, of heads sliced out of a wider tensor) at 16 / 16 heads:

    .venv/bin/python -m tools.experiments.rotary_prompt [--spellings]
"""

from __future__ import annotations

import sys
import time

import numpy as np

HEAD = 64
SHAPES = ((1, 16), (1, 512), (8, 512))  # (batch, prompt tokens)
SPELLINGS = {"rotate_half": {}, "gpt-j": {"before": True, "interleaved": True, "rotary": 32},
             "gpt-neox": {"sliced": True, "rotary": 16}}


def main() -> None:
    import tests.rewrite.test_rotary as graphs
    from mha_onnx.runtime.ort import OrtRunner

    runs = [(name, 16, 16) for name in SPELLINGS] if "--spellings" in sys.argv[1:] else \
        [("rotate_half", 4, 2), ("rotate_half", 16, 4)]
    for spelling, heads, kv_heads in runs:
        graphs.N, graphs.G, graphs.D = heads, kv_heads, HEAD
        original = graphs._model(**SPELLINGS[spelling])
        _, folded = graphs._folded(original, rows=8192)
        runners = [OrtRunner(m.SerializeToString(), "cpu", threads=2, spinning=False)
                   for m in (original, folded)]
        for batch, seq in SHAPES:
            feeds = graphs._feeds(batch, seq, np.broadcast_to(np.arange(seq), (batch, seq)),
                                  np.random.default_rng(0))
            times: list[list[float]] = [[], []]
            for round_ in range(400 if seq < 100 else 60):
                for n in ((0, 1) if round_ % 2 else (1, 0)):
                    start = time.perf_counter()
                    runners[n].infer(feeds)
                    times[n].append(time.perf_counter() - start)
            exported, inside = (float(np.median(t)) * 1e3 for t in times)
            print(f"| {spelling} | {heads} / {kv_heads} | {batch} | {seq} | {exported:.3f} | {inside:.3f} | "
                  f"{inside / exported:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
