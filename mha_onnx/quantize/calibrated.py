"""Weights quantized as a config says, with GPTQ's codes written in where its algorithm is
``gptq`` (gptq.py): the activations' Hessians computed once, on the first model that needs
them, and reused by every quantization after it (``--mixed``'s trials)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from mha_onnx.errors import ConfigError
from mha_onnx.quantize import gptq
from mha_onnx.quantize.config import QuantizeConfig
from mha_onnx.quantize.weights import QuantizedWeights, quantize_weights, read_apart

WINDOW, BATCH = 128, 8  # calibration windows of tokens, windows a run


def windows(prompts: Sequence[Sequence[int]], length: int) -> list[list[int]]:
    """Every prompt's tokens one after another, cut into windows of ``length`` (the last,
    shorter one dropped; one window of all of them where they are fewer)."""
    tokens = [t for prompt in prompts for t in prompt]
    if len(tokens) < length:
        return [tokens]
    return [tokens[i:i + length] for i in range(0, len(tokens) - length + 1, length)]


class Quantizer:
    """``quantizer(config)``: quantize_weights(model, config), then GPTQ where asked.
    ``batches()``: the calibration runs' feeds, None where none were given."""

    def __init__(self, model: onnx.ModelProto,
                 batches: Callable[[], list[dict[str, np.ndarray]]] | None,
                 progress: Callable[[str], None] = lambda _: None) -> None:
        self.model, self.batches, self.progress = model, batches, progress
        self._base = onnx.ModelProto()
        self._sums: dict[str, np.ndarray] | None = None
        self._rows = 0
        self._folder = tempfile.TemporaryDirectory(prefix="mha_onnx_gptq_")  # (the Hessians)

    def __call__(self, config: QuantizeConfig) -> QuantizedWeights:
        made = quantize_weights(self.model, config)
        if config.algorithm != "gptq":
            return made
        if self.batches is None:
            raise ConfigError("--algorithm gptq needs text the model reads",
                              hint="--calibration PROMPTS.json (token-id lists, or text read "
                                   "with the tokenizer beside MODEL)")
        weights = list(dict.fromkeys(t.weight for t in made.targets if t.bits == 4))
        sums = self._hessians([t.weight for t in made.targets if t.bits])
        done = gptq.rewrite(made.model, self._base, {w: sums[w] for w in weights if w in sums},
                            config.block_size)
        left = len(weights) - len(done)
        note = (f"GPTQ: {len(done)} weight(s) from {self._rows} calibration token(s)"
                + (f"; {left} keep RTN's codes (no MatMul on the calibration path reads "
                   "them)" if left else ""))
        return replace(made, notes=(*made.notes, note))

    def _hessians(self, weights: list[str]) -> dict[str, np.ndarray]:
        """X^T X of ``weights`` (every weight the first model quantizes: --mixed's later
        ones quantize no more of them in 4 bits), computed on the first call, kept in files
        mapped from a folder of the quantizer's own (gone with it)."""
        if self._sums is None:
            weights = list(dict.fromkeys(weights))
            base = read_apart(self.model)  # (the weights' names as quantize_weights gives them)
            batches = self.batches()
            self.progress(f"GPTQ: the activations of {len(weights)} weight(s) over "
                          f"{len(batches)} calibration run(s)")
            self._base = base
            self._sums = gptq.hessians(base, weights, batches, Path(self._folder.name))
            self._rows = sum(int(np.prod(b["input_ids"].shape)) for b in batches)
        return self._sums
