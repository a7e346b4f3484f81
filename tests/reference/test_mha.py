"""The reference against a plain numpy transcription of the seed's equations, and against
torch.nn.MultiheadAttention with the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_onnx.config import MhaConfig
from mha_onnx.reference.mha import build_reference
from mha_onnx.reference.weights import to_reference_state


def numpy_mha(params, cfg, query, key, value, padded=None, causal=False):
    """head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V; concat; W^O (loops per head)."""
    def linear(x, name):
        w = params[f"{name}.weight"]
        b = params.get(f"{name}.bias", np.zeros(w.shape[0]))
        return x @ w.T + b

    batch, seq_q, _ = query.shape
    seq_kv = key.shape[1]
    out = np.zeros((batch, seq_q, cfg.v_dim))
    for b in range(batch):
        q_all, k_all, v_all = linear(query[b], "w_q"), linear(key[b], "w_k"), linear(value[b], "w_v")
        for i in range(cfg.num_heads):
            q = q_all[:, i * cfg.d_k : (i + 1) * cfg.d_k]
            k = k_all[:, i * cfg.d_k : (i + 1) * cfg.d_k]
            v = v_all[:, i * cfg.d_v : (i + 1) * cfg.d_v]
            scores = q @ k.T / np.sqrt(cfg.d_k)
            if causal:
                scores = np.where(np.tril(np.ones((seq_q, seq_kv), bool)), scores, -np.inf)
            if padded is not None:
                scores = np.where(padded[b][None, :], -np.inf, scores)
            with np.errstate(invalid="ignore"):
                e = np.exp(scores - scores.max(axis=1, keepdims=True))
                out[b, :, i * cfg.d_v : (i + 1) * cfg.d_v] = (e / e.sum(axis=1, keepdims=True)) @ v
    return linear(out, "w_o")


CASES = [
    MhaConfig(d_model=32, num_heads=4),
    MhaConfig(d_model=48, num_heads=3, d_k=8, d_v=24),
    MhaConfig(d_model=64, num_heads=1, bias=False),
    MhaConfig(d_model=40, num_heads=8, d_k=12, d_v=4, attention="cross"),
]


@pytest.mark.parametrize("mask", ["none", "key-padding", "causal"])
@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"D{c.d_model}-H{c.num_heads}-dk{c.d_k}-dv{c.d_v}")
def test_reference_matches_numpy_equations(cfg, mask):
    cfg = cfg.replace(mask=mask)
    module = build_reference(cfg, seed=3)
    params = {k: v.double().numpy() for k, v in module.state_dict().items()}
    rng = np.random.default_rng(0)
    seq_q, seq_kv = 6, (9 if cfg.attention == "cross" else 6)
    query = rng.standard_normal((2, seq_q, cfg.d_model))
    key = rng.standard_normal((2, seq_kv, cfg.d_model)) if cfg.attention == "cross" else query
    value = rng.standard_normal((2, seq_kv, cfg.d_model)) if cfg.attention == "cross" else query
    padded = None
    if mask == "key-padding":
        padded = np.zeros((2, seq_kv), bool)
        padded[0, -2:] = True
        padded[1, :] = True  # every key padded: NaN, like nn.MultiheadAttention
    want = numpy_mha(params, cfg, query, key, value, padded, causal=mask == "causal")
    t = lambda a: torch.from_numpy(a).float()  # noqa: E731
    with torch.no_grad():
        got = module(
            t(query), t(key) if cfg.attention == "cross" else None,
            t(value) if cfg.attention == "cross" else None,
            torch.from_numpy(padded) if padded is not None else None,
        ).double().numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    if mask == "key-padding":
        assert np.isnan(got[1]).all() and np.isfinite(got[0]).all()


@pytest.mark.parametrize("mask", ["none", "key-padding", "causal"])
@pytest.mark.parametrize("bias", [True, False])
def test_reference_with_torch_mha_weights_matches_torch(mask, bias):
    torch.manual_seed(0)
    torch_mha = torch.nn.MultiheadAttention(64, 4, batch_first=True, bias=bias).eval()
    cfg = MhaConfig(d_model=64, num_heads=4, bias=bias, mask=mask)
    module = build_reference(cfg, to_reference_state(torch_mha.state_dict(), cfg))
    x = torch.randn(3, 11, 64)
    kwargs = {}
    padded = None
    if mask == "key-padding":
        padded = torch.zeros(3, 11, dtype=torch.bool)
        padded[0, 7:] = True
        padded[2, ::2] = True
        kwargs["key_padding_mask"] = padded
    if mask == "causal":
        kwargs["attn_mask"] = torch.ones(11, 11, dtype=torch.bool).triu(1)
    with torch.no_grad():
        want, _ = torch_mha(x, x, x, need_weights=False, **kwargs)
        got = module(x, key_padding_mask=padded)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_seed_makes_weights_reproducible():
    cfg = MhaConfig(d_model=16, num_heads=2)
    a, b, c = build_reference(cfg, seed=1), build_reference(cfg, seed=1), build_reference(cfg, seed=2)
    assert torch.equal(a.w_q.weight, b.w_q.weight)
    assert not torch.equal(a.w_q.weight, c.w_q.weight)
