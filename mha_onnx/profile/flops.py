"""Floating-point work (for GFLOP/s and the roofline): the exact work of one attention layer
of this project's exports, and of any graph the work its matrix kernels did in a profiled
run, from the shapes ORT's profiler recorded."""

from __future__ import annotations

import numpy as np

from mha_onnx.config import MhaConfig


def attention_flops(cfg: MhaConfig, batch: int, seq_q: int, seq_kv: int, kept: int | None = None) -> float:
    """Multiply-adds x 2 of one attention layer: the four projections, Q K^T and A V over the
    (query, key) pairs that are attended (causal: i >= j only; padded keys excluded)."""
    kept = seq_kv if kept is None else kept
    d, h = cfg.d_model, cfg.num_heads
    proj = 2 * batch * (seq_q * d * cfg.qk_dim + seq_kv * d * cfg.qk_dim + seq_kv * d * cfg.v_dim
                        + seq_q * cfg.v_dim * d)
    if cfg.mask == "causal":
        pairs = sum(min(i + 1, seq_kv) for i in range(seq_q))
    else:
        pairs = seq_q * kept
    core = 2 * batch * h * pairs * (cfg.d_k + cfg.d_v)
    return float(proj + core)


# kernels whose work is a product with the last axis of their first input: 2 x out x K
_PRODUCTS = {"MatMul", "FusedMatMul", "MatMulNBits", "Gemm", "MatMulInteger",
             "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}
_ATTENTION = {"MultiHeadAttention", "GroupQueryAttention", "Attention"}


def _shapes(values) -> list[list[int]]:
    return [next(iter(v.values())) for v in values or [] if isinstance(v, dict) and v]


def kernel_flops(op: str, inputs: list[list[int]], outputs: list[list[int]]) -> float:
    """One kernel run's multiply-adds x 2 from its shapes: a matrix product (the weight
    need not be listed: ORT lists activations only), or attention over every query and key
    (Q K^T and A V, dense: a causal mask's skipped pairs are counted)."""
    if not inputs or not outputs:
        return 0.0
    out = float(np.prod(outputs[0]))
    if op in _PRODUCTS:
        return 2.0 * out * inputs[0][-1]
    if op == "Attention":  # ORT's fused encoder block: Q, K and V projected inside it
        batch, length, width = (inputs[0] + [1, 1, 1])[:3] if len(inputs[0]) == 3 else (1, 1, 1)
        return 2.0 * batch * length * width * 3 * outputs[0][-1] + 4.0 * out * length
    if op in _ATTENTION:
        keys = next((s[2] for s in outputs[1:] if len(s) == 4), None)  # present [B,H,T,D]
        if keys is None and len(inputs) > 1 and len(inputs[1]) in (3, 4):
            keys = inputs[1][1] if len(inputs[1]) == 3 else inputs[1][-2]
        return 4.0 * out * (keys or (outputs[0][1] if len(outputs[0]) > 1 else 1))
    return 0.0


def trace_flops(events: list[dict], runs: int) -> float:
    """A profiled run's floating-point work (the matrix kernels of :func:`kernel_flops`,
    the branch each If took), averaged over ``runs``."""
    total = 0.0
    for event in events:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith("_kernel_time"):
            continue
        args = event.get("args", {})
        total += kernel_flops(str(args.get("op_name")), _shapes(args.get("input_type_shape")),
                              _shapes(args.get("output_type_shape")))
    return total / max(1, runs)
