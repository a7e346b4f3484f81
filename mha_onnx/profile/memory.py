"""Memory: what is available now, what one run of a model needs, and the check that refuses
shapes that cannot fit (before a run, not after the machine swaps)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx

from mha_onnx.errors import ResourceError
from mha_onnx.graph.inputs import ShapeCase, input_specs, split_dims
from mha_onnx.table import human_bytes


def available_memory() -> int:
    """Bytes of memory available now (psutil, or /proc/meminfo where psutil is absent)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return 1 << 62


def give_back_memory() -> None:
    """What was freed returned to the system, not kept by the allocator for later: Python's
    cycles collected, then glibc's free lists trimmed (a no-op where libc is not glibc).
    Between the stages of a long job (export: PyTorch's weights, then ORT's), so that one
    stage's freed gigabytes do not stay resident under the next one's."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def estimate_bytes(model: onnx.ModelProto, batch: int, seq_q: int, seq_kv: int | None = None) -> int:
    """Working set of one run of an mha-onnx export: activations, plus the [B, H, S, T]
    scores twice (scores and weights) when its attention is not fused. 0 for other models."""
    from mha_onnx.graph.metadata import config_of

    cfg = config_of(model)
    if cfg is None:
        return 0
    seq_kv = seq_q if seq_kv is None else seq_kv
    item = 2 if cfg.dtype == "float16" else 4
    acts = 8 * batch * max(seq_q, seq_kv) * max(cfg.d_model, cfg.qk_dim, cfg.v_dim) * item
    scores = 2 * batch * cfg.num_heads * seq_q * seq_kv * item if _unfused(model) else 0
    return acts + scores


def _unfused(model: onnx.ModelProto) -> bool:
    from mha_onnx.graph.files import to_ir
    from mha_onnx.rewrite.blocks import find_blocks

    return any(b.kind == "unfused" for b in find_blocks(to_ir(model).graph))


def ensure_fits(model: onnx.ModelProto, cases: Sequence[ShapeCase], *, copies: int = 1,
                hint: str = "use smaller shapes or pass --no-memory-check") -> None:
    """Refuse the first case whose estimated working set (times ``copies`` runs held at once)
    exceeds 90 % of the memory available now."""
    specs = input_specs(model)
    batch_names, seq_names = split_dims(specs)
    available = available_memory()
    for case in cases:
        batch = max([case.dims.get(n, 1) for n in batch_names] or [1])
        lengths = [case.dims.get(n, 1) for n in seq_names] or [1]
        need = copies * estimate_bytes(model, batch, lengths[0], lengths[-1])
        if need > 0.9 * available:
            raise ResourceError(f"shape {case.describe()} needs about {human_bytes(need)}; "
                                f"{human_bytes(available)} is available", hint=hint)
