"""Cutting a piece out of a graph and running it at chosen sizes (for the oracle).

A piece is the slice of nodes that computes some values; it starts at graph inputs, at
values the caller feeds, and at values the slice reads only through Shape/Size whose dims are
known (fed as zeros of that shape, so nothing before them runs: no weights, no fused ops).
Symbolic dims get one value per symbol per assignment; a dim written as a sum of symbols
(``past + seq``) is resolved too.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mha_onnx.graph.dims import lifted
from mha_onnx.graph.expressions import evaluate
from mha_onnx.rewrite.irutil import Dim, const_array, dims
from mha_onnx.rewrite.sdpa import FUSION_DOMAIN

ARITHMETIC = {"Add", "Sub", "Mul", "Div", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
              "Equal", "Min", "Max", "Mod", "Trilu", "Range"}


class Refused(Exception):
    """The piece could not be evaluated (the reason is the message)."""


def input_symbols(graph: ir.Graph) -> list[str]:
    names: dict[str, None] = {}
    for value in graph.inputs:
        for dim in dims(value) or []:
            if isinstance(dim, str):
                names.setdefault(dim)
    return list(names)


def assignments(symbols: list[str], lengths: list[int], floors: dict[str, int] | None = None
                ) -> list[dict[str, int]]:
    """One value per symbol and length, distinct between symbols, alternating which is larger
    (so ``S < T`` and ``S > T`` both occur where they are different dims); a value below its
    symbol's floor (the least size the graph runs at, graphdims.floor_dims) lifted by it."""
    floors = floors or {}
    out = []
    for a, base in enumerate(lengths):
        step = 4 if a % 2 == 0 else -3
        values = {name: max(1, base + n * step) for n, name in enumerate(symbols)}
        out.append({name: lifted(v, floors.get(name, 1)) for name, v in values.items()})
    return out


def resolve(dim: Dim, assignment: dict[str, int]) -> int | None:
    """A dim's value: an int, a symbol, or a sum/difference of symbols and ints."""
    return evaluate(dim, assignment)


class SliceRunner:
    """The piece(s) cut out of the graph as a model of their own, run on ORT CPU."""

    def __init__(self, model: ir.Model, values: list[ir.Value], symbols: set[str],
                 fed: tuple[ir.Value, ...] = ()) -> None:
        inputs = boundary(values, symbols, fed)
        owner = values[0].producer().graph if values and values[0].producer() else None
        source: ir.Graph | ir.GraphView = model.graph
        if owner is not None and owner is not model.graph:  # an If branch (merged decoders):
            # a view, so that the outer values the branch reads may bound the piece
            source = ir.GraphView(list(owner.inputs), list(owner.outputs), nodes=list(owner),
                                  opset_imports=model.graph.opset_imports)
        try:
            graph = ir.convenience.extract(source, inputs, _unique(values))
        except ValueError as exc:
            raise Refused(f"the mask cannot be cut out of the graph ({exc})") from exc
        if any(node.domain == FUSION_DOMAIN for node in graph):
            raise Refused("the mask is computed from the sizes of an earlier attention "
                          "block's output (a view of its scores, as Swin's windows and DETR's masks are)")
        self.graph = graph
        self.inputs = [(v.name, v.dtype, dims(v) or []) for v in graph.inputs]
        self.inputs_by_id = {id(v): v.name for v in inputs}
        self.outputs = [v.name for v in graph.outputs]
        self.value_names = [v.name for v in values]
        piece = ir.Model(graph, ir_version=min(model.ir_version, 10))
        self._proto = ir.to_proto(piece)
        self._session = None

    def constants(self) -> list[int]:
        """Integer constants that take part in arithmetic on indices (window sizes)."""
        found = set()
        for node in self.graph:
            if node.op_type not in ARITHMETIC:
                continue
            for value in node.inputs:
                array = const_array(value)
                if array is None or array.dtype.kind not in "iu" or array.size > 4:
                    continue
                found.update(abs(int(x)) for x in array.reshape(-1) if 2 <= abs(int(x)) < 2**31)
        return sorted(found)

    def run(self, assignment: dict[str, int],
            given: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """The values at ``assignment``: inputs in ``given`` as given, others zeros."""
        from mha_onnx.runtime.ort import OrtRunner

        if self._session is None:
            self._session = OrtRunner(self._proto.SerializeToString(), "cpu", optimization="none")
        feeds = dict(given or {})
        for name, dtype, shape in self.inputs:
            if name not in feeds:
                concrete = [resolve(d, assignment) or 1 for d in shape]
                feeds[name] = np.zeros(concrete, dtype=dtype.numpy())
        try:
            out = self._session.infer(feeds)
        except Exception as exc:  # noqa: BLE001 - any failure means: not proven
            raise Refused(f"the mask could not be evaluated at {assignment}: {exc}") from exc
        return [out[name] for name in self.value_names]


def _unique(values: list[ir.Value]) -> list[ir.Value]:
    return list({id(v): v for v in values}.values())


def known(value: ir.Value, symbols: set[str]) -> bool:
    """Are all of ``value``'s dims ints or expressions of the inputs' symbols?"""
    shape = dims(value)
    probe = dict.fromkeys(symbols, 1)
    return shape is not None and all(resolve(d, probe) is not None for d in shape)


def boundary(values: list[ir.Value], symbols: set[str],
              fed: tuple[ir.Value, ...] = ()) -> list[ir.Value]:
    """Where the slice of ``values`` starts: graph inputs, the values in ``fed``, and values
    that the slice reads only through Shape/Size and whose dims are known (fed as zeros of
    that shape, so nothing before them runs)."""
    stack, data, shape_only = list(values), set(), {}
    found = {id(v): v for v in fed}
    while stack:
        value = stack.pop()
        if id(value) in data:
            continue
        data.add(id(value))
        shape_only.pop(id(value), None)
        node = value.producer()
        if id(value) in found:
            continue
        if node is None:
            if not value.is_initializer() and value.const_value is None:
                found[id(value)] = value
            continue
        if node.op_type in ("Shape", "Size") and known(node.inputs[0], symbols):
            if id(node.inputs[0]) not in data:
                shape_only[id(node.inputs[0])] = node.inputs[0]
            continue
        stack.extend(v for v in node.inputs if v is not None)
    return list({**found, **shape_only}.values())
