"""Which attention kernels a decode step ran (validate): a fused KV-cache model picks its
form at run time (GQA with past for a step whose rows keep their new token, the general
form otherwise), so a chain that passes says little until it says which path it took. A
step is replayed once on ONNX Runtime CPU with its profiler on, and the attention kernels
it ran are counted (the kernels inside an ``If``'s taken branch included)."""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "PackedAttention",
                 "SparseAttention", "DecoderMaskedMultiHeadAttention", "Loop")


def attention_kernels(model: str, feeds: Mapping[str, np.ndarray], specs: Sequence[Any],
                      pairs: Mapping[str, str], shared: bool, rows: Any) -> Counter:
    """op type -> how many times it ran in one run of ``model`` on ``feeds`` (appended
    interface; a shared-buffer model runs behind its adapter)."""
    from mha_onnx.graph.cache import SharedCache
    from mha_onnx.runtime.ort import OrtRunner, read_profile

    with tempfile.TemporaryDirectory(prefix="mha_onnx_kernels_") as folder:
        runner = OrtRunner(model, "cpu", profile_dir=folder, strict=False,
                           prepacking=False)  # (the same kernels, no packed weights)
        try:
            run = SharedCache(runner, specs, pairs, rows=rows) if shared else runner
            run.infer(dict(feeds))
            trace = runner.end_profiling()
            events = read_profile(trace) if trace else []
        finally:
            runner.close()
    return Counter(e.op_type for e in events if e.op_type in ATTENTION_OPS)


def describe(kernels: Counter) -> str:
    """``GroupQueryAttention x2`` (most frequent first), or that none ran."""
    if not kernels:
        return "no attention kernel (unfused)"
    return ", ".join(f"{op} x{n}" for op, n in kernels.most_common())
