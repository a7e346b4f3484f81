"""Operators on shape data: ``Shape``, ``Gather``, ``Slice``, ``Concat``, ``(Un)Squeeze``,
``Cast`` and integer arithmetic and comparisons (with broadcasting), their values carried as
arrays of dims. A handler is ``handler(facts, node)``: it sets the node's outputs with
``facts.set``, or raises and leaves them unknown."""

from __future__ import annotations

import numpy as np
import onnx
import sympy
from onnx import helper, numpy_helper

from mha_onnx.graph.symbolic.facts import DATA_MAX, Facts, axes_of, is_literal
from mha_onnx.graph.walk import attr

_BOOL = onnx.TensorProto.BOOL
_INT64 = onnx.TensorProto.INT64
_BIG = 2 ** 62  # an end past any dim ("to the end")


def _constant(inf: Facts, node: onnx.NodeProto) -> None:
    a = node.attribute[0]
    if a.name == "value":
        array = numpy_helper.to_array(a.t)
        elem = a.t.data_type
        if array.dtype.kind == "f" and array.size <= DATA_MAX:
            inf.floats[node.output[0]] = array
    elif a.name in ("value_int", "value_ints"):
        array, elem = np.array(helper.get_attribute_value(a), np.int64), _INT64
    elif a.name in ("value_float", "value_floats"):
        array, elem = np.array(helper.get_attribute_value(a), np.float32), 1
    else:
        raise ValueError(f"Constant {a.name}")
    data = array.astype(np.int64) if array.dtype.kind in "iub" else None
    inf.set(node.output[0], elem, list(array.shape), data)


def _shape(inf: Facts, node: onnx.NodeProto) -> None:
    shape = inf.shape(node.input[0])
    if shape is None:
        raise ValueError("rank unknown")
    rank = len(shape)
    start, end = attr(node, "start", 0), attr(node, "end", rank)
    picked = shape[max(min(start + rank if start < 0 else start, rank), 0):
                   max(min(end + rank if end < 0 else end, rank), 0)]
    inf.set(node.output[0], _INT64, [len(picked)], np.array(picked, dtype=object))


def _size(inf: Facts, node: onnx.NodeProto) -> None:
    shape = inf.shape(node.input[0])
    data = None if shape is None else np.array(sympy.Mul(*shape), dtype=object)
    inf.set(node.output[0], _INT64, [], data)


def _gather(inf: Facts, node: onnx.NodeProto) -> None:
    shape, indices = inf.shape(node.input[0]), inf.shape(node.input[1])
    if shape is None or indices is None:
        raise ValueError("rank unknown")
    axis = attr(node, "axis", 0) % len(shape)
    data, picks = inf.value(node.input[0]), inf.literal(node.input[1])
    value = None
    if data is not None and picks is not None:
        value = np.take(data, picks, axis=axis)
    inf.set(node.output[0], inf.elems.get(node.input[0]),
            shape[:axis] + indices + shape[axis + 1:], value)


def _slice(inf: Facts, node: onnx.NodeProto) -> None:
    shape = inf.shape(node.input[0])
    if shape is None:
        raise ValueError("rank unknown")
    if inf.opset < 10:
        starts, ends, axes = (attr(node, k) for k in ("starts", "ends", "axes"))
        steps = None
    else:
        starts, ends = inf.value(node.input[1]), inf.value(node.input[2])
        axes = axes_of(inf, node, 3)
        steps = inf.literal(node.input[4]) if len(node.input) > 4 and node.input[4] else None
    if starts is None or ends is None:
        out = [inf.fresh(node, 0, a) for a in range(len(shape))] if axes is None else [
            inf.fresh(node, 0, a) if a in {x % len(shape) for x in axes} else d
            for a, d in enumerate(shape)]
        inf.set(node.output[0], inf.elems.get(node.input[0]), out)
        return
    starts, ends = list(np.reshape(starts, -1)), list(np.reshape(ends, -1))
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else [int(s) for s in np.reshape(steps, -1)]
    out = list(shape)
    data = inf.value(node.input[0])
    picks = [slice(None)] * len(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis %= len(shape)
        length = _length(shape[axis], inf.dim(start), inf.dim(end), step)
        out[axis] = inf.fresh(node, 0, axis) if length is None else length
        if data is not None and all(is_literal(v) for v in (start, end)):
            picks[axis] = slice(int(start), int(min(int(end), _BIG)), step)
        else:
            data = None
    value = data[tuple(picks)] if data is not None else None
    inf.set(node.output[0], inf.elems.get(node.input[0]), out, value)


def _length(dim, start, end, step: int):
    """How many a slice ``start:end:step`` of a dim takes; None where it is not decided.
    A literal start or end is taken as within a symbolic dim (as ORT does); a symbolic
    one must be provably below or above it."""
    first, last = _bound(dim, start, step), _bound(dim, end, step)
    if first is None or last is None:
        return None
    span = (last - first) if step > 0 else (first - last)
    length = sympy.ceiling(span / abs(step)) if abs(step) != 1 else span
    return sympy.Integer(0) if length.is_Integer and length < 0 else length


def _bound(dim, at, step: int):
    """Where a slice's start or end falls on a dim (-1 for "before the first" backwards)."""
    low = sympy.Integer(0 if step > 0 else -1)
    if at.is_Integer:
        if at >= _BIG // 2:
            return dim if step > 0 else dim - 1
        if at <= -_BIG // 2:
            return low
        if at < 0:
            at = dim + at
        if dim.is_Integer:
            return max(low, min(at, dim if step > 0 else dim - 1))
        return at
    if at.is_nonpositive is True:  # -n: from the end (n > 0 where the graph runs)
        at = dim + at
    if (dim - at).is_nonnegative is True:
        return at
    if (at - dim).is_nonnegative is True:
        return dim
    return None


def _concat(inf: Facts, node: onnx.NodeProto) -> None:
    shapes = [inf.shape(x) for x in node.input]
    if any(s is None for s in shapes):
        raise ValueError("rank unknown")
    axis = attr(node, "axis") % len(shapes[0])
    out = list(shapes[0])
    out[axis] = sympy.Add(*(s[axis] for s in shapes))
    for s in shapes[1:]:
        for a, d in enumerate(s):
            if a != axis:
                out[a] = inf.unify(out[a], d)
    values = [inf.value(x) for x in node.input]
    data = None if any(v is None for v in values) else np.concatenate(values, axis=axis)
    inf.set(node.output[0], inf.elems.get(node.input[0]), out, data)


def _unsqueeze(inf: Facts, node: onnx.NodeProto) -> None:
    shape, axes = inf.shape(node.input[0]), axes_of(inf, node, 1)
    if shape is None or axes is None:
        raise ValueError("rank or axes unknown")
    rank = len(shape) + len(axes)
    picked = sorted(a % rank for a in axes)
    out = list(shape)
    for a in picked:
        out.insert(a, sympy.Integer(1))
    data = inf.value(node.input[0])
    inf.set(node.output[0], inf.elems.get(node.input[0]), out,
            None if data is None else data.reshape([int(d) for d in out]))


def _squeeze(inf: Facts, node: onnx.NodeProto) -> None:
    shape, axes = inf.shape(node.input[0]), axes_of(inf, node, 1)
    if shape is None:
        raise ValueError("rank unknown")
    if axes is None:
        if not all(d.is_Integer for d in shape):
            raise ValueError("which axes are 1 is not known")
        picked = {a for a, d in enumerate(shape) if d == 1}
    else:
        picked = {a % len(shape) for a in axes}
    out = [d for a, d in enumerate(shape) if a not in picked]
    data = inf.value(node.input[0])
    inf.set(node.output[0], inf.elems.get(node.input[0]), out,
            None if data is None else data.reshape([int(d) for d in out]))


def _cast(inf: Facts, node: onnx.NodeProto) -> None:
    to = attr(node, "to")
    data = inf.value(node.input[0]) if to != _BOOL else None  # (shapes cast to float too)
    inf.set(node.output[0], to, inf.shape(node.input[0]), data)


def _identity(inf: Facts, node: onnx.NodeProto) -> None:
    inf.set(node.output[0], inf.elems.get(node.input[0]), inf.shape(node.input[0]),
            inf.value(node.input[0]))


_COMPARE = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor",
            "Not"}
_ARITHMETIC = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b,
               "Mul": lambda a, b: a * b, "Div": lambda a, b: a // b,
               "Max": sympy.Max, "Min": sympy.Min, "Mod": sympy.Mod}


def _elementwise(inf: Facts, node: onnx.NodeProto) -> None:
    """Broadcasting operators: the broadcast shape (symbols merged), the element type of
    their kind and, for integer arithmetic on shape data, the value."""
    names = [x for x in node.input if x]
    shape = inf.broadcast(*(inf.shape(x) for x in names))
    if node.op_type in _COMPARE:
        elem = _BOOL
    elif node.op_type == "Where":
        elem = inf.elems.get(node.input[1]) or inf.elems.get(node.input[2])
    else:
        elem = next((inf.elems[x] for x in names if x in inf.elems), None)
    inf.set(node.output[0], elem, shape, _data(inf, node, names))


def _data(inf: Facts, node: onnx.NodeProto, names: list[str]):
    values = [inf.value(x) for x in names]
    if any(v is None for v in values):
        return None
    pick = np.frompyfunc
    if node.op_type in _ARITHMETIC and len(values) == 2:
        return pick(_ARITHMETIC[node.op_type], 2, 1)(*values)
    if node.op_type == "Neg":
        return -values[0]
    if node.op_type == "Equal":
        same = np.asarray(pick(_equal, 2, 1)(*values), dtype=object)
        return None if any(s is None for s in np.reshape(same, -1)) else same.astype(int)
    if node.op_type == "Where" and inf.literal(names[0]) is not None:
        return np.where(inf.literal(names[0]).astype(bool), values[1], values[2])
    return None


def _equal(a, b) -> bool | None:
    """Whether two dims are equal; None where it is not decided. A symbolic value is a size,
    never negative (how TorchScript's ``expand`` tests for -1)."""
    if a == b:
        return True
    if (a - b).is_zero is False or any(x.is_Integer and x < 0 and not y.is_Integer
                                       for x, y in ((a, b), (b, a))):
        return False
    return None



OPS = {"Constant": _constant, "Shape": _shape, "Size": _size, "Gather": _gather,
       "Slice": _slice, "Concat": _concat, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
       "Cast": _cast, "Identity": _identity, "Neg": _elementwise}
OPS.update((op, _elementwise) for op in (
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where",
    "BitShift", "PRelu", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
    "And", "Or", "Xor"))
