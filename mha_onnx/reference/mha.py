"""The PyTorch reference: the seed's multi-head attention, written out equation by equation.

    head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V
    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O

W_i^Q, W_i^K in R^{d_model x d_k} and W_i^V in R^{d_model x d_v} are stacked head by head
into one nn.Linear each (rows i*d_k:(i+1)*d_k of ``w_q.weight`` are (W_i^Q)^T), and
W^O in R^{h d_v x d_model} is ``w_o``. Masked scores are filled with -inf before the softmax,
so a query whose keys are all masked gives NaN, exactly as torch.nn.MultiheadAttention does.

Dims: B batch, S query length, T key/value length, D d_model, H heads, Dk/Dv head dims.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from mha_onnx.config import MhaConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class MultiHeadAttention(nn.Module):
    """Multi-head attention of the seed; the module every export and parity check rests on."""

    def __init__(self, config: MhaConfig) -> None:
        super().__init__()
        self.config = config
        d, h = config.d_model, config.num_heads
        self.w_q = nn.Linear(d, h * config.d_k, bias=config.bias)
        self.w_k = nn.Linear(d, h * config.d_k, bias=config.bias)
        self.w_v = nn.Linear(d, h * config.d_v, bias=config.bias)
        self.w_o = nn.Linear(h * config.d_v, d, bias=config.bias)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool | None = None,
    ) -> torch.Tensor:
        """query (B, S, D); key/value (B, T, D) or None for self-attention;
        key_padding_mask (B, T) bool, True = padded key. Returns (B, S, D)."""
        cfg = self.config
        key = query if key is None else key
        value = key if value is None else value
        causal = cfg.mask == "causal" if causal is None else causal
        q_BHSDk, k_BHTDk, v_BHTDv = self.heads(query, key, value)
        return self.attend(q_BHSDk, k_BHTDk, v_BHTDv, key_padding_mask, causal)

    def heads(self, query, key, value):
        """The projections split into heads: (B, H, S, Dk), (B, H, T, Dk), (B, H, T, Dv)."""
        cfg = self.config
        batch, seq_q, _ = query.shape
        seq_kv = key.shape[1]
        h = cfg.num_heads
        q_BHSDk = self.w_q(query).view(batch, seq_q, h, cfg.d_k).transpose(1, 2)
        k_BHTDk = self.w_k(key).view(batch, seq_kv, h, cfg.d_k).transpose(1, 2)
        v_BHTDv = self.w_v(value).view(batch, seq_kv, h, cfg.d_v).transpose(1, 2)
        return q_BHSDk, k_BHTDk, v_BHTDv

    def attend(self, q_BHSDk, k_BHTDk, v_BHTDv, key_padding_mask=None, causal=False):
        """softmax(Q K^T / sqrt(d_k) + masks) V, heads concatenated and projected. Causal is
        top-left (query i sees keys 0..i, PyTorch's is_causal) or, with a KV cache, aligned to
        the end of the keys (query i sits at position T - S + i)."""
        cfg = self.config
        batch, _, seq_q, _ = q_BHSDk.shape
        seq_kv = k_BHTDk.shape[2]
        scores_BHST = (q_BHSDk @ k_BHTDk.transpose(-2, -1)) / math.sqrt(cfg.d_k)
        if causal:
            ones_ST = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=q_BHSDk.device)
            keep_ST = ones_ST.tril(diagonal=seq_kv - seq_q) if cfg.kv_cache else ones_ST.tril()
            scores_BHST = scores_BHST.masked_fill(~keep_ST, float("-inf"))
        if key_padding_mask is not None:
            padded_B11T = key_padding_mask[:, None, None, :]
            scores_BHST = scores_BHST.masked_fill(padded_B11T, float("-inf"))
        weights_BHST = torch.softmax(scores_BHST, dim=-1)
        heads_BHSDv = weights_BHST @ v_BHTDv
        concat_BSHDv = heads_BHSDv.transpose(1, 2).reshape(batch, seq_q, -1)
        return self.w_o(concat_BSHDv)

    def step(self, query, past_key, past_value, key_padding_mask=None):
        """One step with a KV cache: query (B, S, D); past (B, H, P, D). Returns the output
        (B, S, D) and the present keys and values (B, H, P + S, D)."""
        q_BHSDk, k_new, v_new = self.heads(query, query, query)
        k_BHTDk = torch.cat([past_key, k_new], dim=2)
        v_BHTDv = torch.cat([past_value, v_new], dim=2)
        out = self.attend(q_BHSDk, k_BHTDk, v_BHTDv, key_padding_mask, causal=True)
        return out, k_BHTDk, v_BHTDv


def build_reference(
    config: MhaConfig,
    state_dict: dict[str, torch.Tensor] | None = None,
    *,
    seed: int = 0,
) -> MultiHeadAttention:
    """The reference module in eval mode and the config's dtype; random weights from ``seed``
    unless ``state_dict`` (in this module's naming, see :mod:`mha_onnx.reference.weights`) is given."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        module = MultiHeadAttention(config)
    finally:
        torch.random.set_rng_state(generator_state)
    if state_dict is not None:
        module.load_state_dict(state_dict, strict=True)
    return module.to(TORCH_DTYPES[config.dtype]).eval()


def run_reference(module32: MultiHeadAttention, feeds: dict) -> dict[str, np.ndarray]:
    """The float32 reference module's outputs for the contract's ``feeds`` (numpy arrays;
    float inputs upcast), by output name."""
    args = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()}
    for name in ("query", "key", "value", "past_key", "past_value"):
        if name in args:
            args[name] = args[name].float()
    with torch.no_grad():
        if module32.config.kv_cache:
            out, present_key, present_value = module32.step(
                args["query"], args["past_key"], args["past_value"], args.get("key_padding_mask"))
            return {"output": out.numpy(), "present_key": present_key.numpy(),
                    "present_value": present_value.numpy()}
        out = module32(args["query"], args.get("key"), args.get("value"),
                       args.get("key_padding_mask"))
    return {"output": out.numpy()}
