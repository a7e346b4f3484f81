"""The next token of each row from its last logits: greedy (argmax), or sampled after
temperature, top-k and top-p, in that order (transformers' order of its warpers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mha_onnx.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``sample=False``: the argmax (the others unused)."""

    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be > 0, got {self.temperature}",
                              hint="greedy decoding is the default without --sample")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {self.top_k}", hint="0: no top-k")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}", hint="1: no top-p")

    def to_dict(self) -> dict[str, Any]:
        if not self.sample:
            return {"sample": False}
        return {"sample": True, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "seed": self.seed}


def next_tokens(logits_BV: np.ndarray, sampling: Sampling, rng: np.random.Generator
                ) -> np.ndarray:
    """int64 [B]: the chosen token of each row."""
    if not sampling.sample:
        return np.argmax(logits_BV, axis=-1).astype(np.int64)
    scores = logits_BV.astype(np.float64) / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = np.partition(scores, -sampling.top_k, axis=-1)[:, -sampling.top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    if sampling.top_p < 1:
        scores = _top_p(scores, sampling.top_p)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    cumulative = probs.cumsum(axis=-1)
    draws = rng.random((probs.shape[0], 1)) * cumulative[:, -1:]
    chosen = (cumulative < draws).sum(axis=-1)
    return np.minimum(chosen, probs.shape[-1] - 1).astype(np.int64)


def _top_p(scores: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the most probable tokens whose probabilities sum to ``top_p`` (at least one)."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    ordered = np.take_along_axis(scores, order, axis=-1)
    probs = np.exp(ordered - ordered[:, :1])
    probs /= probs.sum(axis=-1, keepdims=True)
    before = probs.cumsum(axis=-1) - probs  # the mass of the more probable tokens
    drop_sorted = before >= top_p
    drop = np.empty_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, -np.inf, scores)
