"""The dispatching model of a tuning (see :mod:`mha_onnx.tune.rules`): the rules as a table the
graph reads, and each candidate the rules name in one branch of its own.

The rules are data: three constant vectors (each rule's length bound, batch bound and
candidate), and the graph computes which candidate runs as ``Gather(candidate,
ArgMax(L < length_bound and B < batch_bound))`` (the first rule that applies). A candidate
named by several rules is one branch, not one per rule: before, the causal export's seven
rules made a tuned file 7x its original (a copy of the weights per deep branch).

The branches form a chain: ``If(k == 0)`` the first candidate, else ``If(k == 1)`` the
second, ... ONNX Runtime 1.31 prepacks a MatMul's constant weight from the MatMul's own
graph or the one above it, not from two levels up (a branch two Ifs down with its weights
in the main graph ran 1.10-1.31x slower: ``tools/experiments/deep_branch.py``). So each
candidate's weights are held by the graph just above its branch: the main graph for the
first If's two branches, the else graph of each If for the branches inside it, where the
two candidates there share equal tensors (stored once). A weight a candidate's own Ifs read
stays in its branch, one level above them. The candidates are in the order the rules first
name them: the first rule's (the shortest lengths, where an If's own cost shows most) is
one If down. Built with onnx-ir: a branch reads the dispatching model's inputs and the
weights above it as the same value objects, so nothing is renamed by matching strings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mha_onnx.rewrite.irutil import all_graphs, subgraphs
from mha_onnx.tune.rules import ORIGINAL, Rule

NO_BOUND = np.iinfo(np.int64).max


def dispatch(candidates: Mapping[str, onnx.ModelProto], rules: Sequence[Rule], dim: str,
             batch_dim: str = "", stored: dict[str, dict[str, str]] | None = None
             ) -> onnx.ModelProto:
    """A model that runs, for its length ``dim`` (and batch ``batch_dim``, where a rule
    bounds it), the candidate of the first rule that applies (one rule: that candidate
    itself). ``stored``, if given, is filled with each rule's candidate's initializer names
    and the names they have in the model."""
    base = candidates[ORIGINAL]
    stored = {} if stored is None else stored
    names = list(dict.fromkeys(r.name for r in rules))
    if len(names) == 1:
        out = onnx.ModelProto()
        out.CopyFrom(candidates[names[0]])
        stored[names[0]] = {i.name: i.name for i in out.graph.initializer}
        return out
    interface = ir.from_proto(base.graph)
    inputs = [ir.Value(name=v.name, type=v.type, shape=v.shape) for v in interface.inputs]
    opsets: dict[str, int] = {}
    for model in candidates.values():
        for imp in model.opset_import:
            opsets[imp.domain] = max(opsets.get(imp.domain, 0), imp.version)
    graph = ir.Graph(inputs, [], nodes=[], opset_imports=opsets, name=base.graph.name)
    which = _which(graph, rules, names, dim, batch_dim)
    models = {name: ir.from_proto(candidates[name]) for name in names}
    outer = {v.name: v for v in inputs}
    graph.outputs.extend(_chain(models, names, 0, graph, outer, which,
                                list(interface.outputs), stored))
    made = ir.Model(graph, ir_version=max(m.ir_version for m in candidates.values()),
                    producer_name=base.producer_name, producer_version=base.producer_version)
    out = ir.to_proto(made)
    out.metadata_props.extend(base.metadata_props)
    return out


def _const(name: str, values) -> ir.Node:
    return ir.node("Constant", [], {"value": ir.tensor(np.array(values, np.int64), name=name)},
                   outputs=[ir.Value(name=name)])


def _which(graph: ir.Graph, rules: Sequence[Rule], names: list[str], dim: str,
           batch_dim: str) -> ir.Value:
    """Nodes computing ``tune/candidate`` (appended to ``graph``): the index in ``names`` of
    the first rule's candidate that applies at the input's length (and batch)."""
    sizes = [(size, value, bounds) for size, value, bounds in (
        (dim, "tune/length", [r.below for r in rules]),
        (batch_dim, "tune/batch", [r.batch_below for r in rules]))
        if any(b is not None for b in bounds)]  # (what no rule bounds is not read)
    tests = []
    for size, value, bounds in sizes:
        where = next(((i, a) for i in graph.inputs for a, d in enumerate(i.shape or ())
                      if isinstance(d, ir.SymbolicDim) and d.value == size), None)
        if where is None:
            raise ValueError(f"no input has the dim {size!r}")
        shape = ir.node("Shape", [where[0]], {"start": where[1], "end": where[1] + 1},
                        outputs=[ir.Value(name=value)])
        bound = _const(f"{value}_bound", [NO_BOUND if b is None else b for b in bounds])
        less = ir.node("Less", [shape.outputs[0], bound.outputs[0]],
                       outputs=[ir.Value(name=f"{value}_applies")])
        graph.extend([shape, bound, less])
        tests.append(less.outputs[0])
    if len(tests) == 2:
        both = ir.node("And", tests, outputs=[ir.Value(name="tune/applies")])
        graph.append(both)
        tests = list(both.outputs)
    cast = ir.node("Cast", tests, {"to": ir.DataType.INT32},
                   outputs=[ir.Value(name="tune/applies_int")])
    rule = ir.node("ArgMax", cast.outputs, {"axis": 0, "keepdims": 0},
                   outputs=[ir.Value(name="tune/rule")])
    table = _const("tune/candidate_of_rule", [names.index(r.name) for r in rules])
    pick = ir.node("Gather", [table.outputs[0], rule.outputs[0]], {"axis": 0},
                   outputs=[ir.Value(name="tune/candidate")])
    graph.extend([cast, rule, table, pick])
    return pick.outputs[0]


def _chain(models: Mapping[str, ir.Model], names: list[str], first: int, graph: ir.Graph,
           outer: dict[str, ir.Value], which: ir.Value, outputs: list[ir.Value],
           stored: dict[str, dict[str, str]]) -> list[ir.Value]:
    """Nodes computing values like ``outputs`` (appended to ``graph``, which holds the
    weights of the branches its If reads): If(candidate == first) its branch, else the next
    (in an else graph of its own, holding the weights of the branches inside it, while two
    or more are left). Returns the If's outputs."""
    def branch(n: int) -> ir.Graph:
        made, stored[names[n]] = _branch(models[names[n]], f"tune/{names[n]}/", outer, graph,
                                         f"tune/w{first}/" if first else "")
        return made

    then = branch(first)
    if first + 2 == len(names):
        other = branch(first + 1)
    else:
        other = ir.Graph([], [], nodes=[], name=f"tune_else_{first}")
        renamed = [ir.Value(name=f"tune/d{first}/{v.name}", type=v.type, shape=v.shape)
                   for v in outputs]
        other.outputs.extend(_chain(models, names, first + 1, other, outer, which, renamed,
                                    stored))
    index = _const(f"tune/is_{first}_index", first)
    equal = ir.node("Equal", [which, index.outputs[0]], outputs=[ir.Value(name=f"tune/is_{first}")])
    choice = ir.node("If", equal.outputs, {"then_branch": then, "else_branch": other},
                     outputs=[ir.Value(name=v.name, type=v.type, shape=v.shape)
                              for v in outputs])
    graph.extend([index, equal, choice])
    return list(choice.outputs)


def _branch(candidate: ir.Model, prefix: str, outer: dict[str, ir.Value], holder: ir.Graph,
            holder_prefix: str) -> tuple[ir.Graph, dict[str, str]]:
    """One candidate's graph as an If branch: what it computes prefixed (a subgraph may not
    redefine outer names), what it read from its inputs read from ``outer``, its
    initializers moved to ``holder`` (the graph above the branch, under ``holder_prefix``:
    one tensor where an equal one is there by that name already, else under the candidate's
    prefix), but for those the candidate's own subgraphs read: they stay in the branch
    (prefixed), one level above their readers. Returns the branch and where each
    initializer went."""
    graph = candidate.graph
    below = _read_below(graph)
    where: dict[str, str] = {}
    for name, value in list(graph.initializers.items()):
        graph.initializers.pop(name)
        if name in below:
            value.name = where[name] = f"{prefix}{name}"
            graph.register_initializer(value)
            continue
        target = f"{holder_prefix}{name}"
        kept = holder.initializers.get(target)
        if kept is not None and not _equal(kept, value):
            target, kept = f"{prefix}{name}", None  # (the same name, another tensor)
        where[name] = target
        if kept is None:
            value.name = target
            holder.register_initializer(value)
        else:
            value.replace_all_uses_with(kept)
    for node in graph:
        for value in node.outputs:
            if value.name and value.name not in outer:
                value.name = f"{prefix}{value.name}"
    for value in list(graph.inputs):
        value.replace_all_uses_with(outer[value.name], replace_graph_outputs=True)
    graph.inputs.clear()
    graph.name = prefix.rstrip("/")
    return graph, where


def _read_below(graph: ir.Graph) -> set[str]:
    """The names the subgraphs of ``graph``'s nodes read (at any depth)."""
    return {value.name for node in graph for sub in subgraphs(node) for below in all_graphs(sub)
            for inner in below for value in inner.inputs if value is not None}


def _equal(a: ir.Value, b: ir.Value) -> bool:
    """Two initializers of equal type, shape and bytes."""
    x, y = a.const_value, b.const_value
    return x is not None and y is not None and x.dtype == y.dtype \
        and tuple(x.shape) == tuple(y.shape) and x.tobytes() == y.tobytes()
