"""A mixture of experts' routes held to the original's while a fused graph is verified.

A router's ``TopK`` (or ``ArgMax``) is a discrete choice: two experts whose scores differ by
less than the rounding of the dtype trade places under any change of arithmetic, and the
token then runs through another expert, so its output differs by far more than any
tolerance. In float16 the fused attention's own rounding (not a wrong kernel) flips such
near-ties, and the comparison could not tell the two apart. Verification therefore runs
the original with each router's chosen indices as extra outputs, and the fused graph with
those indices fed in place of its own choice (the scores at them gathered from its own
router, so that their weights still come from the fused graph's values): whatever still
differs is the rewrite's. The routers are the main graph's TopK/ArgMax nodes that both
graphs have (the rewrite leaves them as they are).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

CHOICES = ("TopK", "ArgMax")


@dataclass(frozen=True)
class Route:
    index: int  # the node's position in the fused graph
    node: onnx.NodeProto  # the fused graph's TopK/ArgMax, as it was
    chosen: str  # the value of the chosen indices (the same name in both graphs)


def routes(original: onnx.ModelProto, fused: onnx.ModelProto) -> list[Route]:
    """The routers both main graphs hold: the same op writing the same indices value."""
    theirs = {_indices(n): n.op_type for n in original.graph.node if n.op_type in CHOICES}
    return [Route(i, n, _indices(n)) for i, n in enumerate(fused.graph.node)
            if n.op_type in CHOICES and theirs.get(_indices(n)) == n.op_type and n.domain in (
                "", "ai.onnx")]


def _indices(node: onnx.NodeProto) -> str:
    return node.output[1] if node.op_type == "TopK" else node.output[0]


def chosen_values(model: onnx.ModelProto, ops: tuple[str, ...] = CHOICES) -> list[str]:
    """The chosen-indices values of the main graph's routers of ``ops``, in graph order."""
    return [_indices(n) for n in model.graph.node if n.op_type in ops
            and n.domain in ("", "ai.onnx") and len(n.output) > (n.op_type == "TopK")
            and _indices(n)]


def chosen_as_outputs(original: onnx.ModelProto, held: list[Route]):
    """``original`` with the routers' indices added to its outputs, while inside."""
    return indices_as_outputs(original, [r.chosen for r in held])


@contextmanager
def indices_as_outputs(model: onnx.ModelProto, names: list[str]) -> Iterator[list[str]]:
    """``model`` with the int64 values ``names`` added to its outputs, while inside (the
    proto is changed in place and put back: a copy of a large model would double its
    memory); yields the names added (those not outputs already)."""
    added = [name for name in names if name not in {o.name for o in model.graph.output}]
    before = len(model.graph.output)
    model.graph.output.extend(
        helper.make_tensor_value_info(name, TensorProto.INT64, None) for name in added)
    try:
        yield added
    finally:
        del model.graph.output[before:]


@contextmanager
def chosen_as_inputs(fused: onnx.ModelProto, held: list[Route]) -> Iterator[None]:
    """``fused`` with each router replaced by an input of its indices (and, for a TopK, its
    scores gathered at them), while inside; put back as it was after."""
    graph = fused.graph
    nodes = list(graph.node)
    inputs = len(graph.input)
    replaced = {r.index: r for r in held}
    new_nodes = []
    for i, node in enumerate(nodes):
        route = replaced.get(i)
        if route is None:
            new_nodes.append(node)
        elif node.op_type == "TopK" and node.output[0]:
            axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
            new_nodes.append(helper.make_node("GatherElements", [node.input[0], route.chosen],
                                              [node.output[0]], axis=axis,
                                              name=f"{node.name}_held"))
    graph.input.extend(helper.make_tensor_value_info(r.chosen, TensorProto.INT64, None)
                       for r in held)
    del graph.node[:]
    graph.node.extend(new_nodes)
    try:
        yield
    finally:
        del graph.node[:]
        graph.node.extend(nodes)
        del graph.input[inputs:]
