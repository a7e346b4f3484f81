"""The facts symbolic inference keeps about a model's values, and how dims are read, compared
and merged (engine.py reads graphs with them; data_ops.py and shape_ops.py, operators)."""

from __future__ import annotations

import numpy as np
import onnx
import sympy

from mha_onnx.graph import expressions
from mha_onnx.graph.walk import attr

DATA_MAX = 64  # elements: larger integer tensors carry no value
INTS = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16,
         onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL}


def symbol(name: str) -> sympy.Symbol:
    return expressions.symbol(name)


def parse_dim(text: str) -> sympy.Expr:
    """A dim's text as an expression (``past + seq``, ``floor(seq/2)``); a symbol of the whole
    text where it is not arithmetic graph/expressions.py reads."""
    found = expressions.to_sympy(text)
    return symbol(text) if found is None else found


class Facts:
    """The facts of one model's values: ``shapes`` (a list of dims, or None for an unknown
    rank), ``elems`` (element types) and ``data`` (an object array of dims, for small
    integer tensors)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.opsets = [o for o in model.opset_import]
        self.opset = max([o.version for o in model.opset_import
                          if o.domain in ("", "ai.onnx")] or [1])
        self.shapes: dict[str, list | None] = {}
        self.elems: dict[str, int] = {}
        self.data: dict[str, np.ndarray] = {}
        self.floats: dict[str, np.ndarray] = {}  # small float constants (Resize's scales)
        self.merged: dict[sympy.Symbol, sympy.Expr] = {}
        self.kept: set[sympy.Symbol] = set()  # the inputs' symbols: never merged away
        self.declared: dict[str, onnx.ValueInfoProto] = {}  # the graph's own value_info
        self.branch_dims: set[sympy.Symbol] = set()  # where an If's branches differ
        self.unknown = 0
        self._fresh = 0

    # -- facts ------------------------------------------------------------------------
    def set(self, name: str, elem: int | None, shape, data=None) -> None:
        if not name:
            return
        if elem:
            self.elems[name] = elem
        self.shapes[name] = None if shape is None else [self.dim(d) for d in shape]
        if data is not None and np.size(data) <= DATA_MAX:
            data = np.asarray(data, dtype=object)
            self.data[name] = np.vectorize(self.dim, otypes=[object])(data) if data.size else data

    def dim(self, d) -> sympy.Expr:
        if isinstance(d, sympy.Basic):
            return d
        if isinstance(d, (bool, int, np.integer, np.bool_)):
            return sympy.Integer(int(d))
        return parse_dim(str(d))

    def shape(self, name: str) -> list | None:
        shape = self.shapes.get(name) if name else None
        if shape is None or not self.merged:
            return shape
        return [self.resolve(d) for d in shape]

    def value(self, name: str) -> np.ndarray | None:
        """The value of a small integer tensor, as an object array of dims."""
        found = self.data.get(name) if name else None
        if found is None or not self.merged:
            return found
        return np.vectorize(self.resolve, otypes=[object])(found) if found.size else found

    def literal(self, name: str) -> np.ndarray | None:
        """The value as an int64 array when every entry is a number."""
        found = self.value(name)
        if found is None or not all(is_literal(v) for v in found.reshape(-1)):
            return None
        return np.array([int(v) for v in found.reshape(-1)], np.int64).reshape(found.shape)

    def resolve(self, d):
        for _ in range(8):
            if not isinstance(d, sympy.Basic) or d.is_Integer:
                return d
            done = d.xreplace(self.merged)
            if done == d:
                return d
            d = done
        return d

    def fresh(self, node: onnx.NodeProto, out: int, axis: int) -> sympy.Symbol:
        self._fresh += 1
        return symbol(f"{node.op_type}_{self._fresh}_o{out}_d{axis}")

    # -- broadcasting -----------------------------------------------------------------
    def broadcast(self, *shapes) -> list | None:
        if any(s is None for s in shapes):
            return None
        rank = max((len(s) for s in shapes), default=0)
        out = []
        for axis in range(rank):
            dims = [s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0]
            d = dims[0]
            for other in dims[1:]:
                d = self.unify(d, other)
            out.append(d)
        return out

    def unify(self, a, b):
        a, b = self.resolve(a), self.resolve(b)
        if a == b or b == 1:
            return a
        if a == 1:
            return b
        if a.is_Integer or b.is_Integer:
            keep, drop = (a, b) if a.is_Integer else (b, a)
        else:
            keep, drop = a, b
        self._merge(drop, keep)
        return keep

    def _merge(self, drop, keep) -> None:
        """``drop`` and ``keep`` are equal: the one that is a derived symbol is replaced."""
        if keep.is_Integer and not drop.is_Symbol:  # an expression known to be a number
            self.merged[drop] = keep
            return
        for old, new in ((drop, keep), (keep, drop)):
            if (isinstance(old, sympy.Symbol) and old not in self.kept
                    and old not in new.free_symbols):
                self.merged[old] = new
                return


def is_literal(dim) -> bool:
    return isinstance(dim, (int, np.integer)) or (isinstance(dim, sympy.Basic) and dim.is_Integer)


def axes_of(inf: Facts, node: onnx.NodeProto, position: int) -> list[int] | None:
    """Axes from the attribute (older opsets) or the input at ``position``; None if absent."""
    axes = attr(node, "axes")
    if axes is None and len(node.input) > position and node.input[position]:
        found = inf.literal(node.input[position])
        if found is None:
            raise ValueError("axes not known")
        axes = found.reshape(-1).tolist()
    return None if axes is None else [int(a) for a in axes]
