"""What an integer input is, read from how the graph uses it: indices into a table (token
ids, bounded by the table's rows) or a 0/1 mask (Hugging Face's ``attention_mask``), followed
through the ops that keep values and into If branches (Optimum's merged decoders)."""

from __future__ import annotations

from collections.abc import Iterator

import onnx

_KEEPS_VALUES = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Expand", "Identity", "Slice",
                 "Flatten", "Transpose", "Tile"}
_INDEX_INPUT = {"Gather": 1, "GatherElements": 1, "GatherND": 1}
_MASK_USES = {"Where", "Mul", "Sub", "Add", "Equal", "Not", "And", "Or", "Xor", "CumSum",
              "ReduceSum", "ReduceMax", "ReduceMin", "Less", "Greater", "LessOrEqual",
              "GreaterOrEqual", "Neg", "GatherND", "Compress"}


def integer_roles(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """Integer inputs by use: indices into a table (ids, bounded by its rows) or values used
    as a mask (0/1). Followed through ops that keep values, into subgraphs."""
    uses_of = consumers(model.graph)  # If branches too (Optimum's merged decoders)
    rows = {t.name: t.dims[0] for t in model.graph.initializer if t.dims}
    roles = {}
    for value in model.graph.input:
        frontier, seen, bounds, uses = [value.name], set(), [], set()
        while frontier:
            name = frontier.pop()
            if name in seen:
                continue
            seen.add(name)
            for node, index in uses_of.get(name, []):
                if _INDEX_INPUT.get(node.op_type) == index:
                    uses.add("index")
                    if node.input[0] in rows:
                        bounds.append(int(rows[node.input[0]]))
                elif (node.op_type in _KEEPS_VALUES or node.op_type in _INDEX_INPUT) \
                        and index == 0:  # a gather's output holds some of the data's values
                    frontier.extend(node.output)
                elif node.op_type in _MASK_USES:
                    uses.add("mask")
        if bounds:
            roles[value.name] = ("ids", max(1, min(bounds)))
        elif uses == {"mask"}:
            roles[value.name] = ("mask", 2)
    return roles


def consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    """value name -> the (node, input index) pairs that read it, subgraphs included."""
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in all_nodes(graph):
        for index, name in enumerate(node.input):
            out.setdefault(name, []).append((node, index))
    return out


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g)
            for sub in attr.graphs:
                yield from all_nodes(sub)
