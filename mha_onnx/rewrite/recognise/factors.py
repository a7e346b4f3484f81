"""Constant factors on attention scores: a scalar (the 1/sqrt(d) scale, however spelt) or one
per head (Swin-v2's learned logit scale), peeled off the value they multiply."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import const_array, const_scalar, producer


def scalar_factor(node: ir.Node) -> tuple[ir.Value, float] | None:
    """For Mul/Div by a finite, non-zero constant scalar: (the other operand, the factor)."""
    a, b = node.inputs[0], node.inputs[1]
    if node.op_type == "Mul":
        for x, c in ((a, b), (b, a)):
            value = const_scalar(c)
            if value is not None and math.isfinite(value) and value != 0:
                return x, value
    if node.op_type == "Div":
        value = const_scalar(b)
        if value is not None and math.isfinite(value) and value != 0:
            return a, 1.0 / value
    return None


def head_factor(node: ir.Node) -> tuple[ir.Value, np.ndarray] | None:
    """For Mul by a constant of one finite, non-zero factor per head ([H, 1, 1] or [1, H, 1,
    1] against [B, H, S, T] scores): (the other operand, the [H] factors)."""
    if node.op_type != "Mul":
        return None
    for x, c in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        array = const_array(c)
        if array is None or array.ndim < 3 or array.ndim > 4 or array.shape[-3] < 2 \
                or array.size != array.shape[-3] or array.dtype.kind != "f":
            continue
        factors = array.reshape(-1).astype(np.float64)
        if np.all(np.isfinite(factors)) and np.all(factors != 0):
            return x, factors
    return None


def strip_scale(value: ir.Value) -> tuple[ir.Value, float]:
    """Peel Mul/Div by constants off ``value``: (the unscaled value, the product)."""
    factor = 1.0
    for _ in range(4):
        node = producer(value, "Mul", "Div")
        found = scalar_factor(node) if node is not None else None
        if found is None:
            break
        value, f = found
        factor *= f
    return value, factor
