"""Operators whose output shape is made from data or arithmetic on dims: ``Reshape``,
``Expand``, ``ConstantOfShape``, ``Range``, ``Tile``, ``Pad``, ``Resize``, ``MatMul``
(broadcast batch dims), ``Transpose``, reductions (and the max/min of shape data), and the
lengths of convolutions and pools."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import sympy
from onnx import numpy_helper

from mha_onnx.graph.symbolic.facts import DATA_MAX, Facts, axes_of, is_literal
from mha_onnx.graph.walk import attr

_BOOL = onnx.TensorProto.BOOL
_INT64 = onnx.TensorProto.INT64


def _reshape(inf: Facts, node: onnx.NodeProto) -> None:
    shape, target = inf.shape(node.input[0]), inf.value(node.input[1])
    if target is None:
        size = inf.shape(node.input[1])
        if size is None or not size[0].is_Integer:
            raise ValueError("target unknown")
        out = [inf.fresh(node, 0, a) for a in range(int(size[0]))]
        inf.set(node.output[0], inf.elems.get(node.input[0]), out)
        return
    target = list(target.reshape(-1))
    keep_zero = attr(node, "allowzero", 0)
    out = [shape[a] if (d == 0 and not keep_zero and shape is not None) else d
           for a, d in enumerate(target)]
    if any(d == 0 and not keep_zero for d in target) and shape is None:
        raise ValueError("a 0 in the target of an input of unknown rank")
    if -1 in out:
        if shape is None:
            out[out.index(-1)] = inf.fresh(node, 0, out.index(-1))
        else:
            known = sympy.Mul(*(d for d in out if d != -1))
            out[out.index(-1)] = _quotient(sympy.Mul(*shape), known)
    data = inf.value(node.input[0])
    value = None
    if data is not None and all(is_literal(d) for d in out):
        value = data.reshape([int(d) for d in out])
    inf.set(node.output[0], inf.elems.get(node.input[0]), out, value)


@functools.lru_cache(maxsize=4096)
def _quotient(total, known):
    """``total / known`` for a reshape's -1: sympy's own cancelling (most), ``cancel``
    where a denominator is left; the quotient as it is where that leaves one too (Swin's
    padded windows: ``simplify`` took seconds there and left it)."""
    q = total / known
    return q if sympy.fraction(q)[1] == 1 else sympy.cancel(q)


def _expand(inf: Facts, node: onnx.NodeProto) -> None:
    target = inf.value(node.input[1])
    if target is None:
        raise ValueError("target unknown")
    shape = inf.broadcast(inf.shape(node.input[0]), list(target.reshape(-1)))
    inf.set(node.output[0], inf.elems.get(node.input[0]), shape)


def _constant_of_shape(inf: Facts, node: onnx.NodeProto) -> None:
    target = inf.value(node.input[0])
    fill = attr(node, "value")
    elem = fill.data_type if fill is not None else onnx.TensorProto.FLOAT
    if target is None:
        length = inf.shape(node.input[0])
        if length is None or not length[0].is_Integer:
            raise ValueError("rank unknown")
        inf.set(node.output[0], elem, [inf.fresh(node, 0, a) for a in range(int(length[0]))])
        return
    dims = list(target.reshape(-1))
    data = None
    if all(is_literal(d) for d in dims) and int(np.prod([int(d) for d in dims])) <= DATA_MAX:
        first = numpy_helper.to_array(fill).reshape(-1)[0] if fill is not None else 0
        if np.asarray(first).dtype.kind in "iub":
            data = np.full([int(d) for d in dims], int(first), dtype=np.int64)
    inf.set(node.output[0], elem, dims, data)


def _range(inf: Facts, node: onnx.NodeProto) -> None:
    start, limit, delta = (inf.value(x) for x in node.input)
    if start is None or limit is None or delta is None:
        out = [inf.fresh(node, 0, 0)]
    else:
        start, limit, delta = (v.reshape(-1)[0] for v in (start, limit, delta))
        span = sympy.ceiling((limit - start) / delta)
        out = [sympy.Integer(0) if span.is_Integer and span < 0 else span]
    inf.set(node.output[0], inf.elems.get(node.input[0]), out)


def _pad(inf: Facts, node: onnx.NodeProto) -> None:
    shape = inf.shape(node.input[0])
    pads = attr(node, "pads") if inf.opset < 11 else inf.value(node.input[1])
    if shape is None or pads is None:
        raise ValueError("unknown")
    pads = [inf.dim(p) for p in np.reshape(pads, -1)]
    axes = axes_of(inf, node, 3) if inf.opset >= 18 else None
    axes = list(range(len(shape))) if axes is None else [a % len(shape) for a in axes]
    out = list(shape)
    for i, axis in enumerate(axes):
        out[axis] = out[axis] + pads[i] + pads[i + len(axes)]
    inf.set(node.output[0], inf.elems.get(node.input[0]), out)


def _resize(inf: Facts, node: onnx.NodeProto) -> None:
    shape = inf.shape(node.input[0])
    sizes = inf.value(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    scales = inf.floats.get(node.input[2 if inf.opset >= 11 else 1])
    if shape is None or (sizes is None and scales is None):
        raise ValueError("unknown")
    if sizes is not None:
        out = list(sizes.reshape(-1))
    else:
        out = [d if s == 1 else sympy.floor(d * sympy.nsimplify(float(s)))
               for d, s in zip(shape, scales.reshape(-1), strict=True)]
    inf.set(node.output[0], inf.elems.get(node.input[0]), out)


def _tile(inf: Facts, node: onnx.NodeProto) -> None:
    shape, repeats = inf.shape(node.input[0]), inf.value(node.input[1])
    if shape is None or repeats is None:
        raise ValueError("unknown")
    inf.set(node.output[0], inf.elems.get(node.input[0]),
            [d * r for d, r in zip(shape, repeats.reshape(-1), strict=True)])


def _matmul(inf: Facts, node: onnx.NodeProto) -> None:
    a, b = inf.shape(node.input[0]), inf.shape(node.input[1])
    if a is None or b is None:
        raise ValueError("rank unknown")
    left, right = (a if len(a) > 1 else [1] + a), (b if len(b) > 1 else b + [1])
    inf.unify(left[-1], right[-2])
    out = inf.broadcast(left[:-2], right[:-2]) + [left[-2], right[-1]]
    if len(a) == 1:
        del out[-2]
    if len(b) == 1:
        del out[-1]
    inf.set(node.output[0], inf.elems.get(node.input[0]), out)


def _transpose(inf: Facts, node: onnx.NodeProto) -> None:
    shape = inf.shape(node.input[0])
    if shape is None:
        raise ValueError("rank unknown")
    perm = attr(node, "perm") or list(reversed(range(len(shape))))
    data = inf.value(node.input[0])
    inf.set(node.output[0], inf.elems.get(node.input[0]), [shape[p] for p in perm],
            None if data is None else np.transpose(data, perm))


def _reduce(inf: Facts, node: onnx.NodeProto) -> None:
    """Reductions' shapes (axes an attribute or an input), and the max/min of shape data."""
    shape = inf.shape(node.input[0])
    if shape is None:
        raise ValueError("rank unknown")
    axes = axes_of(inf, node, 1)
    keep = attr(node, "keepdims", 1)
    if axes is None or not axes:
        axes = [] if attr(node, "noop_with_empty_axes", 0) else list(range(len(shape)))
    picked = {a % len(shape) for a in axes} if shape else set()
    out = [sympy.Integer(1) if a in picked else d for a, d in enumerate(shape)
           if keep or a not in picked]
    data, value = inf.value(node.input[0]), None
    if (data is not None and data.ndim <= 1 and data.size and picked <= {0}
            and node.op_type in ("ReduceMax", "ReduceMin")):
        if all(is_literal(v) for v in data.reshape(-1)):
            found = (max if node.op_type == "ReduceMax" else min)(int(v) for v in data)
            value = np.array([found] if keep else found, dtype=object)
    inf.set(node.output[0], inf.elems.get(node.input[0]), out, value)


def _window(inf: Facts, node: onnx.NodeProto) -> None:
    """Conv and pools: each spatial length from the kernel, strides, pads and dilations."""
    shape = inf.shape(node.input[0])
    if shape is None:
        raise ValueError("rank unknown")
    spatial = len(shape) - 2
    if node.op_type == "Conv":
        weight = inf.shape(node.input[1])
        kernel, channels = weight[2:], weight[0]
    else:
        kernel, channels = [sympy.Integer(k) for k in attr(node, "kernel_shape")], shape[1]
    strides = attr(node, "strides") or [1] * spatial
    dilations = attr(node, "dilations") or [1] * spatial
    pads = attr(node, "pads") or [0] * (2 * spatial)
    auto = attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    rounding = sympy.ceiling if attr(node, "ceil_mode", 0) else sympy.floor
    out = [shape[0], channels]
    for i, length in enumerate(shape[2:]):
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            out.append(sympy.ceiling(length / strides[i]))
            continue
        reach = dilations[i] * (kernel[i] - 1) + 1
        span = length + pads[i] + pads[i + spatial] - reach
        if auto == "VALID":
            span = length - reach
        out.append(rounding(span / strides[i]) + 1)
    inf.set(node.output[0], inf.elems.get(node.input[0]), out)
    for extra in node.output[1:]:
        inf.set(extra, _INT64, out)


OPS = {"Reshape": _reshape, "Expand": _expand, "ConstantOfShape": _constant_of_shape,
       "Range": _range, "Tile": _tile, "Pad": _pad, "Resize": _resize, "MatMul": _matmul,
       "Transpose": _transpose, "Conv": _window, "MaxPool": _window, "AveragePool": _window}
OPS.update((op, _reduce) for op in (
    "ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1",
    "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"))
