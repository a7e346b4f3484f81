"""What an integer input is, read from how the graph uses it: indices into a table (token
ids, bounded by the table's rows) or a 0/1 mask (Hugging Face's ``attention_mask``), followed
through the ops that keep values and into If branches (Optimum's merged decoders)."""

from __future__ import annotations

import onnx
import onnx.numpy_helper

from mha_onnx.graph.walk import all_nodes

_KEEPS_VALUES = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Expand", "Identity", "Slice",
                 "Flatten", "Transpose", "Tile"}
_INDEX_INPUT = {"Gather": 1, "GatherElements": 1, "GatherND": 1}
# ops that look an input up in a table that is another of their inputs: {index input: table}
# (ORT's fused embedding, written by its transformers optimizer; a quantized table's Gather)
_TABLES = {"Gather": {1: 0}, "GatherElements": {1: 0}, "GatherND": {1: 0},
           "GatherBlockQuantized": {1: 0}, "EmbedLayerNormalization": {0: 2, 1: 4, 8: 3}}
_MASK_INPUTS = {"EmbedLayerNormalization": {7}, "Attention": {3}}
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
                table = _TABLES.get(node.op_type, {}).get(index)
                if table is not None:
                    uses.add("index")
                    if len(node.input) > table and node.input[table] in rows:
                        bounds.append(int(rows[node.input[table]]))
                elif index in _MASK_INPUTS.get(node.op_type, ()):
                    uses.add("mask")
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


def length_limit(model: onnx.ModelProto) -> int | None:
    """The longest sequence the graph runs: the rows of a table it gathers from with indices
    that count along the length without reading an input's values (BERT's position ids: a
    constant sliced to the length, or a Range up to it), or the position table of ORT's
    fused embedding given no position ids. None where no such table is found (rotary models
    read their positions from an input). Nodes inside If branches count (an Optimum merged
    decoder gathers its positions there)."""
    graph = model.graph
    nodes = list(all_nodes(graph))
    rows = {t.name: int(t.dims[0]) for t in graph.initializer if len(t.dims) >= 2}
    made_by = {out: node for node in nodes for out in node.output}
    inputs = {v.name for v in graph.input}
    limits = []
    for node in nodes:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in rows \
                and _counts(node.input[1], made_by, inputs, {}) == "length":
            limits.append(rows[node.input[0]])
        elif node.op_type == "EmbedLayerNormalization" and len(node.input) > 3 \
                and node.input[3] in rows and (len(node.input) < 10 or not node.input[9]):
            limits.append(rows[node.input[3]])
    return min(limits) if limits else None


def _counts(name: str, made_by: dict, inputs: set[str], memo: dict[str, str]) -> str:
    """What ``name``'s values follow: "input" (an input's values), "length" (they count
    along a size: a Range or a Slice bounded by a Shape, offset or not), "shape" (a size
    itself), "const" or "other" (computed otherwise: T5's relative buckets)."""
    if name in inputs:
        return "input"
    node = made_by.get(name)
    if node is None:
        return "const"
    if name not in memo:
        memo[name] = "const"  # (a cycle: none in a valid graph)
        kinds = [_counts(i, made_by, inputs, memo) for i in node.input if i]
        if node.op_type == "Slice" and kinds[0] == "const" and "shape" in kinds[1:] \
                and _counts_up(made_by.get(node.input[0])):
            memo[name] = "length"  # (position ids: a constant 0, 1, 2, ... cut to a size)
        else:
            memo[name] = _kind(node, kinds)
    return memo[name]


def _counts_up(node: onnx.NodeProto | None) -> bool:
    """Is ``node`` a Constant holding 0, 1, 2, ... (BERT's position ids buffer)?"""
    if node is None or node.op_type != "Constant" or not node.attribute \
            or node.attribute[0].type != onnx.AttributeProto.TENSOR:
        return False
    values = onnx.numpy_helper.to_array(node.attribute[0].t).reshape(-1)
    return values.size > 1 and bool((values == range(values.size)).all())


def _kind(node: onnx.NodeProto, kinds: list[str]) -> str:
    if node.op_type in ("Shape", "Size"):
        return "shape"
    if "input" in kinds:
        return "input"
    if node.op_type == "Range":
        return "length" if {"shape", "length"} & set(kinds) else "const"
    if node.op_type in _KEEPS_VALUES | {"Gather", "GatherElements", "GatherND"} and kinds:
        return kinds[0]  # (the values are the data's)
    if node.op_type in ("Add", "Sub", "Concat", "Unsqueeze", "Max", "Min"):
        for kind in ("length", "shape"):  # (positions offset; sizes computed)
            if kind in kinds:
                return kind
    return "other" if node.op_type not in ("Constant", "ConstantOfShape") else "const"
