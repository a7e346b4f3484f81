"""Inputs for any ONNX model that honour its dynamic dims: one value per symbolic dim name
(so dims that must agree do), several shape cases, masks with padding patterns.

Used by ``fuse`` (verification) and ``validate``; no torch here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from mha_onnx.errors import InputSpecError

NP_TYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.BOOL: np.bool_,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8,
}
BATCH_NAMES = re.compile(r"batch|^b$|^n$|^N$|^B$", re.IGNORECASE)
MASK_NAMES = re.compile(r"mask|padding", re.IGNORECASE)


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    dims: tuple[int | str | None, ...]


@dataclass(frozen=True)
class ShapeCase:
    """Values for the symbolic dims, and the mask pattern to use."""

    label: str
    dims: dict[str, int]
    padding: str = "some"  # "none" | "some" | "full" (one batch entry fully padded)

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.dims.items())
        return f"{self.label} ({inner})" if inner else self.label


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The model's real inputs (initializers listed as inputs excluded)."""
    initializers = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or tensor.elem_type not in NP_TYPES:
            raise InputSpecError(
                f"input {value.name!r} has a type mha-onnx cannot generate data for"
            )
        dims: list[int | str | None] = []
        for dim in tensor.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(dim.dim_value)
            elif dim.HasField("dim_param"):
                dims.append(dim.dim_param)
            else:
                dims.append(None)
        specs.append(InputSpec(value.name, np.dtype(NP_TYPES[tensor.elem_type]), tuple(dims)))
    return specs


def symbolic_dims(specs: Sequence[InputSpec]) -> list[str]:
    seen: dict[str, None] = {}
    for spec in specs:
        for dim in spec.dims:
            if isinstance(dim, str):
                seen.setdefault(dim)
    return list(seen)


def default_cases(specs: Sequence[InputSpec], *, max_len: int = 64) -> list[ShapeCase]:
    """Cases that vary every dynamic dim: all ones, distinct odd sizes, a larger one with a
    fully padded batch entry. Batch-like dims stay small."""
    names = symbolic_dims(specs)
    odd = [13, 7, 19, 5, 23, 11]
    larger = [min(max_len, v) for v in (40, 64, 33, 57, 24, 48)]

    def pick(values: list[int], batch: int) -> dict[str, int]:
        out, k = {}, 0
        for name in names:
            if BATCH_NAMES.search(name):
                out[name] = batch
            else:
                out[name] = values[k % len(values)]
                k += 1
        return out

    return [
        ShapeCase("ones", {n: 1 for n in names}, padding="none"),
        ShapeCase("odd", pick(odd, 2), padding="some"),
        ShapeCase("longer", pick(larger, 3), padding="full"),
    ]


def parse_shapes(text: str, specs: Sequence[InputSpec]) -> list[ShapeCase]:
    """``B:S[:T],...`` -> cases. B goes to batch-like dims, S to the first other dim name,
    T to the second (key/value length) if the model has one."""
    names = symbolic_dims(specs)
    batch_names = [n for n in names if BATCH_NAMES.search(n)]
    seq_names = [n for n in names if n not in batch_names]
    cases = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        fields = item.split(":")
        if len(fields) not in (2, 3) or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise InputSpecError(
                f"malformed shape {item!r} in --shapes",
                hint="use B:S or B:S:T with positive integers, e.g. --shapes 1:128,4:77:33",
            )
        values = [int(f) for f in fields]
        if len(values) == 3 and len(seq_names) < 2:
            raise InputSpecError(
                f"shape {item!r} gives a key length but the model has one sequence dim",
                hint="use B:S for self-attention models")
        case: dict[str, int] = {n: values[0] for n in batch_names}
        if seq_names:
            case[seq_names[0]] = values[1]
            for n in seq_names[1:]:
                case[n] = values[2] if len(values) == 3 else values[1]
        cases.append(ShapeCase(item, case, padding="some"))
    if not cases:
        raise InputSpecError("--shapes is empty", hint="e.g. --shapes 1:128,4:77:33")
    return cases


def _mask(shape: tuple[int, ...], padding: str, rng: np.random.Generator, keep_value: bool) -> np.ndarray:
    """A [batch, length] style mask: True/1 = ``keep_value`` means kept."""
    keep = np.ones(shape, dtype=bool)
    if len(shape) >= 2 and padding != "none":
        batch, length = shape[0], shape[-1]
        flat = keep.reshape(batch, -1, length)
        for b in range(batch):
            kind = b % 3
            if kind == 1:  # trailing padding
                flat[b, :, max(1, (3 * length) // 4) :] = False
            elif kind == 2:  # all but one key padded
                flat[b, :, :] = False
                flat[b, :, int(rng.integers(0, length))] = True
            elif b > 0:
                flat[b, :, rng.random(length) < 0.3] = False
                flat[b, :, 0] = True
        if padding == "full" and batch > 1:
            flat[batch - 1] = False
    return keep if keep_value else ~keep


def make_inputs(
    specs: Sequence[InputSpec], case: ShapeCase, *, seed: int = 0, int_high: int = 16
) -> dict[str, np.ndarray]:
    """Random inputs for ``case``. Bool inputs named like masks get True = padded (PyTorch's
    key_padding_mask); integer masks get 1 = keep (Hugging Face's attention_mask)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        shape = []
        for dim in spec.dims:
            if isinstance(dim, int):
                shape.append(dim)
            elif isinstance(dim, str):
                shape.append(case.dims.get(dim, 4))
            else:
                shape.append(4)
        shape_t = tuple(shape)
        if spec.dtype == np.bool_:
            feeds[spec.name] = _mask(shape_t, case.padding, rng, keep_value=False)
        elif spec.dtype.kind in "iu":
            if MASK_NAMES.search(spec.name):
                feeds[spec.name] = _mask(shape_t, case.padding, rng, keep_value=True).astype(spec.dtype)
            else:
                feeds[spec.name] = rng.integers(0, int_high, size=shape_t).astype(spec.dtype)
        else:
            feeds[spec.name] = rng.standard_normal(shape_t).astype(spec.dtype)
    return feeds


def iter_feeds(
    specs: Sequence[InputSpec], cases: Sequence[ShapeCase], *, seed: int = 0
) -> Iterator[tuple[ShapeCase, dict[str, np.ndarray]]]:
    for n, case in enumerate(cases):
        yield case, make_inputs(specs, case, seed=seed + n)
