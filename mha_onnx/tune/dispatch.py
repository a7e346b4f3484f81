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
one If down.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mha_onnx.graph.walk import all_nodes, subgraphs
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
    nodes = _which(base, rules, names, dim, batch_dim)
    outer = {i.name for i in base.graph.input}
    held: dict[str, onnx.TensorProto] = {}
    nodes += _chain(candidates, names, 0, list(base.graph.output), outer, held, stored)
    graph = helper.make_graph(nodes, base.graph.name, list(base.graph.input),
                              list(base.graph.output), list(held.values()))
    opsets: dict[str, int] = {}
    for model in candidates.values():
        for imp in model.opset_import:
            opsets[imp.domain] = max(opsets.get(imp.domain, 0), imp.version)
    out = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v)
                                                  for d, v in opsets.items()],
                            ir_version=max(m.ir_version for m in candidates.values()))
    out.producer_name, out.producer_version = base.producer_name, base.producer_version
    out.metadata_props.extend(base.metadata_props)
    return out


def _which(base: onnx.ModelProto, rules: Sequence[Rule], names: list[str], dim: str,
           batch_dim: str) -> list[onnx.NodeProto]:
    """Nodes computing ``tune/candidate``: the index in ``names`` of the first rule's
    candidate that applies at the input's length (and batch)."""
    def const(name: str, values) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.array(values, np.int64), name))

    sizes = [(size, value, bounds) for size, value, bounds in (
        (dim, "tune/length", [r.below for r in rules]),
        (batch_dim, "tune/batch", [r.batch_below for r in rules]))
        if any(b is not None for b in bounds)]  # (what no rule bounds is not read)
    nodes, tests = [], []
    for size, value, bounds in sizes:
        where = next(((i.name, a) for i in base.graph.input
                      for a, d in enumerate(i.type.tensor_type.shape.dim)
                      if d.dim_param == size), None)
        if where is None:
            raise ValueError(f"no input has the dim {size!r}")
        nodes += [helper.make_node("Shape", [where[0]], [value], start=where[1],
                                   end=where[1] + 1),
                  const(f"{value}_bound", [NO_BOUND if b is None else b for b in bounds]),
                  helper.make_node("Less", [value, f"{value}_bound"], [f"{value}_applies"])]
        tests.append(f"{value}_applies")
    if len(tests) == 2:
        nodes.append(helper.make_node("And", tests, ["tune/applies"]))
    applies = "tune/applies" if len(tests) == 2 else tests[0]
    return nodes + [
        helper.make_node("Cast", [applies], ["tune/applies_int"], to=onnx.TensorProto.INT32),
        helper.make_node("ArgMax", ["tune/applies_int"], ["tune/rule"], axis=0, keepdims=0),
        const("tune/candidate_of_rule", [names.index(r.name) for r in rules]),
        helper.make_node("Gather", ["tune/candidate_of_rule", "tune/rule"],
                         ["tune/candidate"], axis=0)]


def _chain(candidates: Mapping[str, onnx.ModelProto], names: list[str], first: int,
           outputs: list[onnx.ValueInfoProto], outer: set[str],
           held: dict[str, onnx.TensorProto], stored: dict[str, dict[str, str]]
           ) -> list[onnx.NodeProto]:
    """Nodes computing ``outputs``: If(candidate == first) its branch, else the next (in an
    else graph of its own, holding the weights of the branches inside it, while two or more
    are left). ``held``: the initializers of the graph these nodes are in."""
    def branch(n: int, holder: dict[str, onnx.TensorProto]) -> onnx.GraphProto:
        graph, stored[names[n]] = _branch(candidates[names[n]], f"tune/{names[n]}/", outer,
                                          holder, f"tune/w{first}/" if first else "")
        return graph

    then = branch(first, held)
    if first + 2 == len(names):
        other = branch(first + 1, held)
    else:
        renamed = []
        for value in outputs:
            copy = onnx.ValueInfoProto()
            copy.CopyFrom(value)
            copy.name = f"tune/d{first}/{value.name}"
            renamed.append(copy)
        inner: dict[str, onnx.TensorProto] = {}
        nodes = _chain(candidates, names, first + 1, renamed, outer, inner, stored)
        other = helper.make_graph(nodes, f"tune_else_{first}", [], renamed, list(inner.values()))
    index = f"tune/is_{first}_index"
    return [helper.make_node("Constant", [], [index], value=numpy_helper.from_array(
                np.array(first, np.int64), index)),
            helper.make_node("Equal", ["tune/candidate", index], [f"tune/is_{first}"]),
            helper.make_node("If", [f"tune/is_{first}"], [o.name for o in outputs],
                             then_branch=then, else_branch=other)]


def _branch(candidate: onnx.ModelProto, prefix: str, outer: set[str],
            holder: dict[str, onnx.TensorProto], holder_prefix: str
            ) -> tuple[onnx.GraphProto, dict[str, str]]:
    """One candidate as an If branch: its values prefixed (a subgraph may not redefine outer
    names), its initializers moved to ``holder`` (the graph above the branch, its names
    under ``holder_prefix``: by name where an equal tensor is there already, compared as raw
    bytes, else under the candidate's prefix), but for
    those the candidate's own subgraphs read: they stay in the branch (prefixed), one level
    above their readers. Returns the branch and where each initializer went."""
    graph = onnx.GraphProto()
    graph.CopyFrom(candidate.graph)
    mapping: dict[str, str] = {}
    below = _read_below(graph)
    inside = []
    for init in graph.initializer:
        if init.name in below:
            mapping[init.name] = f"{prefix}{init.name}"
            copy = onnx.TensorProto()
            copy.CopyFrom(init)
            copy.name = mapping[init.name]
            inside.append(copy)
            continue
        plain = _plain(init)
        name = f"{holder_prefix}{init.name}"
        kept = holder.get(name)
        if kept is not None and (kept.raw_data != plain.raw_data or kept.dims != plain.dims
                                 or kept.data_type != plain.data_type):
            name = f"{prefix}{init.name}"  # (the same name, another tensor)
        mapping[init.name] = name
        plain.name = name
        holder.setdefault(name, plain)
    where = {init.name: mapping[init.name] for init in graph.initializer}
    for node in graph.node:
        for out in node.output:
            if out and out not in outer:
                mapping[out] = f"{prefix}{out}"
    _rename_graph(graph, mapping)
    del graph.initializer[:]
    graph.initializer.extend(inside)
    del graph.input[:]
    graph.name = prefix.rstrip("/")
    return graph, where


def _rename_graph(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    """Rename values in ``graph`` and in its subgraphs' references to them, in place."""
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
        for sub in subgraphs(node):
            _rename_graph(sub, mapping)
    for value in list(graph.output) + list(graph.value_info):
        value.name = mapping.get(value.name, value.name)


def _read_below(graph: onnx.GraphProto) -> set[str]:
    """The names the subgraphs of ``graph``'s nodes read (at any depth)."""
    return {name for node in graph.node for sub in subgraphs(node)
            for below in all_nodes(sub) for name in below.input}


def _plain(init: onnx.TensorProto) -> onnx.TensorProto:
    """An initializer with its data as raw bytes (so that equal tensors compare equal)."""
    return numpy_helper.from_array(numpy_helper.to_array(init), init.name)
