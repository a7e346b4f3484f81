"""Work that only an ``If``'s branches read, moved into them.

ONNX Runtime runs every node of a graph on every run, also those whose values only a branch
that is not taken reads: a fused decoder's general form (the branch a run-time guard rarely
picks) keeps the rotary, layout and mask nodes it reads in the main graph, where a decode
step pays for them. A node whose every use lies inside the branches of one ``If`` moves into
them (a copy per branch where both read it: a run takes one branch, so no run does more
work). A node read by the branches of several ``If`` nodes (one per layer) is copied into
each only where ``shared`` allows it, since a run may take several of them. A kernel that
prepacks its weight goes no further than one level below the weight's graph (PREPACKING).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import all_graphs, insert_first, subgraphs


def sink_into_branches(graph: ir.Graph,
                       shared: Callable[[ir.Node], bool] = lambda node: False) -> int:
    """Move (or copy) nodes of ``graph`` read only inside ``If`` branches into those branches,
    then do the same inside each branch; returns how many nodes were placed."""
    owners: dict[int, tuple[ir.Node, ir.Graph]] = {}  # any graph nested in an If's branch
    for node in graph:
        for branch in _branches(node):
            for nested in all_graphs(branch):
                owners[id(nested)] = (node, branch)
    placed = 0
    for node in reversed(list(graph)):
        targets = _targets(node, graph, owners)
        if not targets or _prepacks_from_above(node, graph):
            continue
        if len({id(owners[id(t)][0]) for t in targets}) > 1 and not shared(node):
            continue
        _place(node, graph, targets)
        placed += 1
    for node in graph:
        for branch in _branches(node):
            placed += sink_into_branches(branch, shared)
    return placed


# Kernels that ONNX Runtime gives a constant weight pre-arranged for its own use (prepacking)
# when the weight is an initializer of the kernel's graph or of the graph right above it, not
# from further up: moved two levels below its weight, a MatMul runs unpacked (measured: the
# key-padding export's fallback branch two Ifs deep, 1.15x slower than the original at batch
# 4, 64 tokens, left-padded; as fast as it with prepacking off in both).
PREPACKING = frozenset({"MatMul", "Gemm", "Conv", "MatMulInteger", "MatMulNBits",
                        "DynamicQuantizeMatMul", "FusedConv", "FusedMatMul"})


def _prepacks_from_above(node: ir.Node, graph: ir.Graph) -> bool:
    """Whether ``node`` is a prepacking kernel reading an initializer of a graph above
    ``graph`` (moved into a branch, it would read it from two levels up)."""
    return node.op_type in PREPACKING and any(
        v is not None and v.is_initializer() and v.graph is not graph for v in node.inputs)


def _branches(node: ir.Node) -> list[ir.Graph]:
    if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
        return []
    return subgraphs(node)


def _targets(node: ir.Node, graph: ir.Graph,
             owners: dict[int, tuple[ir.Node, ir.Graph]]) -> list[ir.Graph]:
    """The branches (top level of each) that read ``node``'s outputs; [] where the node must
    stay: it holds a subgraph, is a graph output, is read in ``graph`` itself or nowhere."""
    if subgraphs(node):
        return []
    found: dict[int, ir.Graph] = {}
    for value in node.outputs:
        if value.is_graph_output():
            return []
        for use in value.uses():
            owner = owners.get(id(use.node.graph))
            if use.node.graph is graph or owner is None:
                return []
            found[id(owner[1])] = owner[1]
    return list(found.values())


def _place(node: ir.Node, graph: ir.Graph, targets: list[ir.Graph]) -> None:
    """``node`` moved to the front of the first target; a copy at the front of each other
    one, read there instead of it. (Nodes are placed last to first: each goes before the
    nodes already placed that read it.)"""
    for n, target in enumerate(targets[1:], start=1):
        copy = ir.Node(node.domain, node.op_type, node.inputs, node.attributes.values(),
                       num_outputs=len(node.outputs), version=node.version,
                       name=f"{node.name}_{n}" if node.name else None)
        inside = {id(g) for g in all_graphs(target)}
        for old, new in zip(node.outputs, copy.outputs, strict=True):
            new.name = f"{old.name}_{n}" if old.name else None
            new.type, new.shape = old.type, old.shape
            for use in list(old.uses()):
                if id(use.node.graph) in inside:
                    use.node.replace_input_with(use.idx, new)
        insert_first(target, copy)
    graph.remove(node, safe=False)
    insert_first(targets[0], node)


def hoist_by_condition(graph: ir.Graph) -> int:
    """Nodes read only inside the else branches of several ``If`` nodes that test one
    condition value (every layer's guard, once tidy.share_guards made it one value: its
    else branch the general form) move into one new ``If`` on that condition ahead of them,
    whose then branch yields empty placeholders (never read: every reader's ``If`` takes its
    else branch with it). Returns how many nodes moved."""
    return sum(_hoist(graph, ifs, "else_branch") for ifs in _same_condition(graph).values())


def _same_condition(graph: ir.Graph) -> dict[int, list[ir.Node]]:
    groups: dict[int, list[ir.Node]] = {}
    for node in graph:
        if _branches(node) and node.inputs and node.inputs[0] is not None:
            groups.setdefault(id(node.inputs[0]), []).append(node)
    return {k: v for k, v in groups.items() if len(v) >= 2}


def _hoist(graph: ir.Graph, ifs: list[ir.Node], branch: str) -> int:
    inside = {id(g) for node in ifs for g in all_graphs(node.attributes[branch].value)}
    order = {id(node): n for n, node in enumerate(graph)}
    first = min(order[id(node)] for node in ifs)
    chosen: dict[int, ir.Node] = {}
    for node in reversed(list(graph)):
        if order[id(node)] >= first or subgraphs(node):
            continue
        uses = [u for v in node.outputs for u in v.uses()]
        if uses and not any(v.is_graph_output() for v in node.outputs) and all(
                id(u.node.graph) in inside or id(u.node) in chosen for u in uses):
            chosen[id(node)] = node
    nodes = [node for node in graph if id(node) in chosen]
    read = [v for node in nodes for v in node.outputs
            if any(id(u.node.graph) in inside for u in v.uses())]
    types = [_dtype(v) for v in read]
    if not read or None in types:
        return 0
    placeholders = [ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(
        np.zeros((0,), t.numpy())))]) for t in types]
    for value, placeholder in zip(read, placeholders, strict=True):
        # named here: a graph names its unnamed values val_N counting from 0, which an
        # outer graph's values may already be called (ORT refuses the repeated name)
        placeholder.outputs[0].name = f"{value.name}_unused"
    computed = ir.Graph([], [], nodes=[], name=f"hoisted_{branch}")
    empty = ir.Graph([], [p.outputs[0] for p in placeholders], nodes=placeholders,
                     name=f"hoisted_{branch}_unused")
    graphs = {branch: computed, _other(branch): empty}
    hoisted = ir.Node("", "If", [ifs[0].inputs[0]],
                      [ir.AttrGraph(name, g) for name, g in graphs.items()],
                      num_outputs=len(read), name=f"hoisted_{branch}")
    graph.insert_before(list(graph)[first], hoisted)
    for value, out in zip(read, hoisted.outputs, strict=True):
        out.name, out.type = f"{value.name}_hoisted", value.type
        for use in list(value.uses()):
            if id(use.node.graph) in inside:
                use.node.replace_input_with(use.idx, out)
    graph.remove(nodes, safe=False)
    computed.extend(nodes)
    computed.outputs.extend(read)
    return len(nodes)


def _other(branch: str) -> str:
    return "else_branch" if branch == "then_branch" else "then_branch"


_BOOLEAN = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Not",
            "Xor", "IsNaN", "IsInf"}
_INT64 = {"Shape", "Size", "NonZero", "ArgMax", "ArgMin"}
_SAME = {"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "Exp", "Log", "Sqrt", "Pow", "Max",
         "Min", "Mod", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Concat",
         "Slice", "Gather", "GatherElements", "Tile", "Identity", "ReduceSum", "ReduceMax",
         "ReduceMin", "ReduceMean", "CumSum", "Range", "Softmax", "Sigmoid", "Tanh", "Trilu",
         "Pad", "Flatten", "Split", "MatMul", "Sin", "Cos", "Erf", "Floor", "Ceil", "Round",
         "Reciprocal", "Clip", "Sign"}  # the element type of their first input


def _dtype(value: ir.Value, depth: int = 16) -> ir.DataType | None:
    """A value's element type: recorded, else what its op makes of its inputs; None where
    that is not known (then nothing is hoisted)."""
    if value.dtype is not None or depth == 0:
        return value.dtype
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in _BOOLEAN:
        return ir.DataType.BOOL
    if node.op_type in _INT64 and value is node.outputs[0]:
        return ir.DataType.INT64
    if node.op_type == "Cast":
        return ir.DataType(node.attributes["to"].value)
    if node.op_type in ("Constant", "ConstantOfShape"):
        attr = node.attributes.get("value")
        if attr is None or attr.type != ir.AttributeType.TENSOR:
            return ir.DataType.FLOAT if node.op_type == "ConstantOfShape" else None
        return attr.value.dtype
    data = {"Where": 1, "CastLike": 1}.get(node.op_type, 0) if node.op_type in _SAME | {
        "Where", "CastLike"} else None
    if data is None or len(node.inputs) <= data or node.inputs[data] is None:
        return None
    return _dtype(node.inputs[data], depth - 1)


def merge_nested_guards(graph: ir.Graph) -> int:
    """``If(c): [If(d): A | B] | C`` (the then branch nothing but the inner If, ``d`` read
    from outside) becomes ``If(c and d): A | [If(c): B | C]``: the run that takes A, the
    common one, pays one If instead of two. Returns how many were merged."""
    merged = 0
    for outer in list(graph):
        branches = dict(zip(("then", "else"), _pair(outer), strict=True)) if _pair(outer) else {}
        inner = _only_if(branches["then"]) if branches else None
        if inner is None:
            continue
        first, second = _pair(inner)
        both = ir.Node("", "And", [outer.inputs[0], inner.inputs[0]],
                       name=f"{outer.name}_and_{inner.name}")
        graph.insert_before(outer, both)
        branches["then"].remove(inner, safe=False)
        rest = ir.Node("", "If", [outer.inputs[0]], [ir.AttrGraph("then_branch", second),
                                                     ir.AttrGraph("else_branch", branches["else"])],
                       num_outputs=len(outer.outputs), name=f"{outer.name}_otherwise")
        for out, value in zip(rest.outputs, outer.outputs, strict=True):
            out.name, out.type = f"{value.name}_otherwise", value.type
        outer.replace_input_with(0, both.outputs[0])
        outer.attributes["then_branch"] = ir.AttrGraph("then_branch", first)
        outer.attributes["else_branch"] = ir.AttrGraph("else_branch", ir.Graph(
            [], rest.outputs, nodes=[rest], name=f"{outer.name}_otherwise"))
        merged += 1
    return merged


def _pair(node: ir.Node) -> tuple[ir.Graph, ir.Graph] | None:
    if not _branches(node):
        return None
    return node.attributes["then_branch"].value, node.attributes["else_branch"].value


def _only_if(branch: ir.Graph) -> ir.Node | None:
    """The branch's one node when it is an If whose condition comes from outside it and
    whose outputs are the branch's outputs."""
    nodes = list(branch)
    if len(nodes) != 1 or _pair(nodes[0]) is None:
        return None
    inner = nodes[0]
    cond = inner.inputs[0]
    if cond is None or (cond.producer() is not None and cond.producer().graph is branch):
        return None
    return inner if list(branch.outputs) == list(inner.outputs) else None
