"""Small helpers over onnx_ir values: constants, producers, symbolic dims."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from mha_onnx.graph.expressions import provably_equal

Dim = int | str | None
MS_DOMAIN = "com.microsoft"
BLOCK = "mha_onnx.block"  # node.meta key: the block id a lowered kernel node computes
STEP = "mha_onnx.one_token"  # node.meta key: a kernel node only one-token runs reach
# node.metadata_props key (saved in the file): a Softmax of a form mha-onnx wrote out (the
# value names it), an attention block fused, not one to fuse or report as left
FORM = "mha_onnx.form"
# How far any walk over the graph goes (score chains, mask expressions, layout ops): one limit,
# so that a block the fusion would accept is always also found and reported.
WALK_LIMIT = 32


def opset(model: ir.Model) -> int:
    """The model's default-domain opset."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))


def producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The node (default ONNX domain) producing ``value`` if its op is one of ``op_types``."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    return node if not op_types or node.op_type in op_types else None


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value as a numpy array when it is an initializer or a Constant's output."""
    if value is None:
        return None
    if value.const_value is not None:
        try:
            return value.const_value.numpy()
        except Exception:  # noqa: BLE001 - external or odd tensors: not a constant to us
            return None
    node = producer(value, "Constant")
    if node is None:
        return None
    for name, attr in node.attributes.items():
        if name == "value":
            return attr.value.numpy()
        if name in ("value_float", "value_int"):
            return np.array(attr.value)
        if name in ("value_floats", "value_ints"):
            return np.array(list(attr.value))
    return None


def const_scalar(value: ir.Value | None) -> float | None:
    """A constant with one element (any rank), as a float."""
    array = const_array(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(()))


def const_fill(value: ir.Value | None) -> float | None:
    """The one value of a constant-filled tensor: a scalar constant, a constant whose
    elements are all equal, Expand(scalar constant, shape) or ConstantOfShape."""
    if value is None:
        return None
    array = const_array(value)
    if array is not None:
        if array.size == 0 or not np.all(array == array.reshape(-1)[0]):
            return None
        return float(array.reshape(-1)[0])
    node = producer(value, "Expand", "ConstantOfShape", "Cast", "Identity")
    if node is None:
        return None
    if node.op_type == "ConstantOfShape":
        attr = node.attributes.get("value")
        return 0.0 if attr is None else float(attr.value.numpy().reshape(-1)[0])
    return const_fill(node.inputs[0])


def const_ints(value: ir.Value | None) -> list[int] | None:
    array = const_array(value)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(x) for x in array.reshape(-1)]


def dims(value: ir.Value | None) -> list[Dim] | None:
    """The value's dims: ints, symbolic names, or None where unknown; None if rank unknown."""
    if value is None or value.shape is None:
        return None
    out: list[Dim] = []
    for dim in value.shape:
        if isinstance(dim, int):
            out.append(dim)
        else:
            out.append(dim.value if dim.value is not None else None)
    return out


def same_dim(a: Dim, b: Dim) -> bool:
    """True only when both dims are known and provably equal (symbolic expressions such as
    torch's ``((seq**2)//seq)`` are simplified first)."""
    if a is None or b is None:
        return False
    if a == b:
        return True
    if isinstance(a, str) and isinstance(b, str) and any(c in "-+*/()" for c in a + b):
        return provably_equal(a, b)
    return False


def int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def ints_attr(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(x) for x in attr.value]


def float_attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else float(attr.value)


def shape_bounds(node: ir.Node, rank: int) -> tuple[int, int]:
    """The [first, last) dims a Shape node of an input of ``rank`` dims reads (its start and
    end attributes, negative ones counted from the end, clamped)."""
    start = node.attributes.get("start")
    end = node.attributes.get("end")
    first = int(start.value) if start is not None else 0
    last = int(end.value) if end is not None else rank
    first = max(0, first + rank if first < 0 else first)
    last = min(rank, last + rank if last < 0 else last)
    return first, last


def replace_shape(graph: ir.Graph, shape_node: ir.Node, whole) -> None:
    """A rank-4 tensor's ``Shape`` node (any start/end) replaced by ``whole(tape)``, the
    full [4] shape built on a tape, sliced the same way."""
    tape = ir.tape.Tape()
    full = whole(tape)
    start, end = shape_node.attributes.get("start"), shape_node.attributes.get("end")
    starts = tape.op("Constant", [], {"value_ints": [start.as_int() if start else 0]})
    ends = tape.op("Constant", [], {"value_ints": [end.as_int() if end else 4]})
    sliced = tape.op("Slice", [full, starts, ends])
    graph.insert_before(shape_node, tape.nodes)
    old = shape_node.outputs[0]
    if old.is_graph_output():  # the model's output keeps its name
        name, old.name = old.name, f"{old.name}_replaced"
        sliced.name = name
    ir.convenience.replace_all_uses_with(old, sliced, replace_graph_outputs=True)


def onehot_dim(tape, axis: int, value: int = 1, rank: int = 4) -> ir.Value:
    """A [rank] int64 constant: ``value`` at ``axis``, the other entries 1 - value."""
    array = np.full(rank, 1 - value, np.int64)
    array[axis] = value
    return tape.op("Constant", [], {"value": ir.tensor(array)})


def insert_first(graph: ir.Graph, nodes: ir.Node | list[ir.Node]) -> None:
    """``nodes`` at the front of ``graph`` (empty or not)."""
    first = next(iter(graph), None)
    if first is None:
        graph.extend([nodes] if isinstance(nodes, ir.Node) else nodes)
    else:
        graph.insert_before(first, nodes)


def take_output(graph: ir.Graph, old: ir.Value, new: ir.Value, suffix: str) -> None:
    """``new`` as the graph output ``old`` was, under its name (``old`` renamed with
    ``suffix``); nothing where ``old`` is no graph output. Other uses of ``old`` stay."""
    for index, output in enumerate(graph.outputs):
        if output is old:
            name, old.name = old.name, f"{old.name}_{suffix}"
            new.name = name
            graph.outputs[index] = new


def replace_node(graph: ir.Graph, node: ir.Node, given: ir.Value) -> None:
    """``given`` in the place of ``node``'s output: every use, the graph output, its name,
    type and shape; ``node`` removed."""
    out = node.outputs[0]
    out.replace_all_uses_with(given, replace_graph_outputs=True)
    name, out.name = out.name, None
    given.name, given.type, given.shape = name, out.type, out.shape
    graph.remove(node, safe=True)


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs a node holds as attributes (If branches, Loop and Scan bodies), in order."""
    out: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            out.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            out.extend(attr.value)
    return out


def all_graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """The graph and every subgraph held in node attributes, depth first (the ONNX-file
    counterpart is graph/walk.py)."""
    yield graph
    for node in graph:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def forget_matches() -> int:
    """Each of onnxscript's module-level rewrite rules (``rules.common``, which faithful.py
    runs) made to let go of the graph it last matched in: onnxscript 0.7's matcher keeps it,
    with the node and the match, until its next match, and so would keep the last model
    fused alive, and through it the weights that model read. How many held one."""
    from onnxscript.rewriter.rules import common

    held = 0
    for rule in vars(common).values():
        matcher = getattr(rule, "_matcher", None)
        if matcher is None:
            continue
        held += getattr(matcher, "_graph", None) is not None
        for name in ("_graph", "_current_node", "_match", "_tracer"):
            if hasattr(matcher, name):
                setattr(matcher, name, None)
    return held
