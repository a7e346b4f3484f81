"""What ``validate`` is asked: providers, shapes, tolerances per output, references."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mha_onnx.errors import InputSpecError
from mha_onnx.graph.inputs import ShapeCase
from mha_onnx.runtime.openvino import reduced_precision
from mha_onnx.stats import default_tolerance


@dataclass(frozen=True)
class Tolerance:
    """Bounds for one output (or all, name "*"): |got - want| <= atol + rtol * |want|."""

    atol: float | None = None
    rtol: float | None = None


@dataclass(frozen=True)
class ValidateConfig:
    providers: tuple[str, ...] = ("cpu",)
    shapes: tuple[ShapeCase, ...] | None = None
    tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    seed: int = 0
    allow_missing: bool = False
    reference: str | None = None
    threads: int | None = None
    memory_check: bool = True
    inputs: str | None = None  # an .npz of real inputs instead of generated ones
    save_outputs: str | None = None  # write inputs, outputs and provenance here
    load_outputs: str | None = None  # run the inputs stored here, compare with its outputs
    force: bool = False  # replace an existing --save-outputs file
    decode_steps: int = 16  # KV-cache models: single-token steps after the prompt
    strict: bool = False  # a golden file saved from another model fails
    bisect: bool = False  # on a failure, name the first node whose output differs
    bisect_chunk: int = 256  # intermediate values exposed per run while bisecting
    ranges: bool = False  # every activation's peak against float16's range (ranges.py)
    # a quantized model's thresholds given (quantize/accuracy.Thresholds' fields): over
    # those it was quantized with (its record), else the defaults
    accuracy: Any = None
    # a line per step that takes time (the CLI prints it as "[validate] ..." on stderr)
    progress: Callable[[str], None] = field(default=lambda _: None, compare=False, repr=False)

    def tolerance_for(self, output: str, dtype: np.dtype, provider: str = "cpu"
                      ) -> tuple[float, float]:
        """--atol/--rtol where given, else the defaults of the output's dtype; a provider
        that computes float32 in bfloat16 (openvino-bf16) gets bfloat16's."""
        if reduced_precision(provider) and np.dtype(dtype) == np.float32:
            dtype = "bfloat16"
        default_atol, default_rtol = default_tolerance(dtype)
        chosen = self.tolerances.get(output) or self.tolerances.get("*") or Tolerance()
        return (default_atol if chosen.atol is None else chosen.atol,
                default_rtol if chosen.rtol is None else chosen.rtol)


def parse_tolerances(atol: Sequence[str], rtol: Sequence[str]) -> dict[str, Tolerance]:
    """``["1e-3", "logits=1e-2"]`` -> {"*": ..., "logits": ...}."""
    out: dict[str, dict[str, float]] = {}
    for kind, items in (("atol", atol), ("rtol", rtol)):
        for item in items:
            name, _, value = item.rpartition("=")
            try:
                number = float(value)
            except ValueError:
                raise InputSpecError(f"malformed --{kind} {item!r}",
                                     hint=f"use --{kind} 1e-4 or --{kind} OUTPUT=1e-4") from None
            if not math.isfinite(number) or number < 0:
                raise InputSpecError(f"--{kind} must be a non-negative number, got {item!r}")
            out.setdefault(name or "*", {})[kind] = number
    return {k: Tolerance(v.get("atol"), v.get("rtol")) for k, v in out.items()}
