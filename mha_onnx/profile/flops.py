"""Exact floating-point work of one attention layer (for GFLOP/s and the roofline)."""

from __future__ import annotations

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
