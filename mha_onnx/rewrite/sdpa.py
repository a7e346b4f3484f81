"""The internal ``mha_onnx.fusion.Sdpa`` op that stage 1 emits and stage 2 lowers, and the
layout helpers both lowerings share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import dims, ints_attr, producer, same_dim


@dataclass(frozen=True)
class SdpaInfo:
    """The attributes and operands of one Sdpa node."""

    query: ir.Value  # [B, H, S, Dk]
    key: ir.Value  # [B, H, T, Dk]
    value: ir.Value  # [B, H, T, Dv]
    mask: ir.Value | None  # bool [B, T] (key_padding) or float bias rank 4 (bias)
    scale: float
    heads: int
    mask_kind: str
    fill: float
    fill_mode: str
    nan_to_zero: bool
    self_attention: bool
    block: str

    @property
    def dk(self) -> int:
        return int(dims(self.query)[3])  # type: ignore[index]

    @property
    def dv(self) -> int:
        return int(dims(self.value)[3])  # type: ignore[index]

    @property
    def np_dtype(self) -> type:
        return np.float16 if self.query.dtype == ir.DataType.FLOAT16 else np.float32

    def const(self, op, value: float) -> ir.Value:
        """A scalar constant in the attention's dtype."""
        return op.Constant(value=ir.tensor(np.array(value, self.np_dtype)))

    @classmethod
    def of(cls, node: ir.Node) -> SdpaInfo:
        attrs = node.attributes
        inputs = list(node.inputs)
        return cls(
            query=inputs[0],
            key=inputs[1],
            value=inputs[2],
            mask=inputs[3] if len(inputs) > 3 else None,
            scale=float(attrs["scale"].value),
            heads=int(attrs["num_heads"].value),
            mask_kind=str(attrs["mask_kind"].value),
            fill=float(attrs["fill"].value),
            fill_mode=str(attrs["fill_mode"].value),
            nan_to_zero=bool(attrs["nan_to_zero"].value),
            self_attention=bool(attrs["self_attention"].value),
            block=str(attrs["block"].value),
        )

    def all_masked_value(self) -> str | None:
        """What the original computes for a query whose keys are all masked, when a fused
        form's kernel may compute something else there: "nan", "zero" (a NaN guard), "mean"
        (one equal score everywhere: uniform weights) or None (softmax(s + fill), which any
        additive form reproduces)."""
        from mha_onnx.rewrite.masks import ABSORBING

        if self.fill == -math.inf:
            return "zero" if self.nan_to_zero else "nan"
        if self.fill_mode == "replace" or self.fill <= ABSORBING:
            return "mean"
        return None

    def describe_fill(self) -> str:
        if self.fill == -math.inf:
            return "-inf"
        return f"{self.fill:g}"


def bsd_source(x4: ir.Value, heads: int) -> ir.Value | None:
    """The [B, S, H*D] tensor that ``x4`` [B, H, S, D] was split from by Reshape+Transpose."""
    transpose = producer(x4, "Transpose")
    if transpose is None or ints_attr(transpose, "perm") != [0, 2, 1, 3]:
        return None
    reshape = producer(transpose.inputs[0], "Reshape")
    if reshape is None:
        return None
    x3 = reshape.inputs[0]
    d3, d4 = dims(x3), dims(reshape.outputs[0])
    if d3 is None or d4 is None or len(d3) != 3 or len(d4) != 4:
        return None
    if not (isinstance(d4[2], int) and isinstance(d4[3], int) and d4[2] == heads):
        return None
    if not (same_dim(d3[0], d4[0]) and same_dim(d3[1], d4[1]) and d3[2] == d4[2] * d4[3]):
        return None
    return x3


def to_bsd(op, x4: ir.Value, heads: int) -> ir.Value:
    """[B, H, S, D] -> [B, S, H*D]: the original 3-D tensor when there is one, else a copy."""
    source = bsd_source(x4, heads)
    if source is not None:
        return source
    return op.Reshape(op.Transpose(x4, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))


def from_bsd(op, x3: ir.Value, heads: int) -> ir.Value:
    """[B, S, H*D] -> [B, H, S, D]."""
    split = op.Reshape(x3, op.Constant(value_ints=[0, 0, heads, -1]))
    return op.Transpose(split, perm=[0, 2, 1, 3])


def seq_dim(op, x: ir.Value, axis: int) -> ir.Value:
    """Shape(x)[axis] as a 1-element int64 tensor."""
    return op.Shape(x, start=axis, end=axis + 1)
