"""Working-set estimates, so that a shape that cannot fit is refused before it runs (an OOM
kill loses the whole run and tells the user nothing)."""

from __future__ import annotations

import json

import onnx

from mha_onnx.config import MhaConfig
from mha_onnx.errors import ResourceError
from mha_onnx.table import human_bytes


def config_of(model: onnx.ModelProto) -> MhaConfig | None:
    """The mha-onnx config recorded in a model's metadata, if any."""
    meta = {p.key: p.value for p in model.metadata_props}
    if "mha_onnx.config" not in meta:
        return None
    return MhaConfig.from_dict(json.loads(meta["mha_onnx.config"]))


def has_unfused_attention(model: onnx.ModelProto) -> bool:
    from mha_onnx.graphio import to_ir
    from mha_onnx.rewrite.blocks import find_blocks

    return any(b.kind == "unfused" for b in find_blocks(to_ir(model).graph))


def estimate_bytes(cfg: MhaConfig | None, unfused: bool, batch: int, seq_q: int,
                   seq_kv: int | None = None) -> int:
    """Working set of one run: activations, plus the [B, H, S, T] scores twice (scores and
    weights) when the attention is not fused. 0 when the model is not an mha-onnx export."""
    if cfg is None:
        return 0
    seq_kv = seq_q if seq_kv is None else seq_kv
    item = 2 if cfg.dtype == "float16" else 4
    acts = 8 * batch * max(seq_q, seq_kv) * max(cfg.d_model, cfg.qk_dim, cfg.v_dim) * item
    scores = 2 * batch * cfg.num_heads * seq_q * seq_kv * item if unfused else 0
    return acts + scores


def ensure_fits(need: int, what: str, hint: str) -> None:
    """Refuse ``what`` when ``need`` bytes exceed 90 % of the memory available now."""
    import psutil

    available = psutil.virtual_memory().available
    if need > 0.9 * available:
        raise ResourceError(f"{what} needs about {human_bytes(need)}; "
                            f"{human_bytes(available)} is available", hint=hint)


