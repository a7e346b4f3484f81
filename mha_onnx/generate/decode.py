"""A shared-cache decoder's decode steps without its run-time choice of form.

A model fused with ``--kv-cache shared`` runs each layer's attention inside an ``If``: the
GroupQueryAttention form when one guard (computed once per run, shared by every layer's
``If``) says the inputs allow it, the exact general form otherwise. A step through the file
as written costs more than its kernels: at 16 layers the int4 step read 1.073x of GenAI's
graph of the same weights as written and 1.010x with the branches inlined (docs/bench.md,
"Decode steps without the Ifs"), although an ``If`` by itself costs ORT about 2-3 us on
one thread (tools/experiments/if_cost.py); with two threads whose pools sleep between
runs it costs more. A generation loop's steps are the case the guard admits by
construction (one new, kept token per row, positions inside the tables the generator checks
first), so the generator can run them through :func:`decode_graph`: every ``If`` replaced
by its then branch, the nodes nothing reads any more removed, and the guard itself kept as
one more output (:data:`GUARD`), read after every step: a step it does not admit is an
error, never a token from the wrong form.
"""

from __future__ import annotations

import onnx

from mha_onnx.graph.walk import all_nodes, subgraphs

GUARD = "mha_onnx_decode_fast_form"  # bool []: the step met the fast form's guard


def guards(model: onnx.ModelProto) -> set[str]:
    """The conditions the ``If`` nodes of the main graph test."""
    return {n.input[0] for n in model.graph.node
            if n.op_type == "If" and n.domain in ("", "ai.onnx")}


def shared_guard(model: onnx.ModelProto) -> str | None:
    """The one condition every ``If`` of the main graph tests (a shared-cache fusion's
    guard), or None where there is no ``If`` or they test different ones."""
    conditions = guards(model)
    return next(iter(conditions)) if len(conditions) == 1 else None


def inline_ifs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every ``If`` of its main graph replaced by the nodes of its
    then branch: what the branch outputs renamed to the ``If``'s outputs, another name it
    defines that the main graph has already suffixed (names are unique per graph only:
    torch.export names a branch's nodes and values as the main graph's); an output the
    branch passes through from outside becomes an Identity."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph, nodes = out.graph, []
    names = {n.name for n in graph.node}
    values = {v.name for v in (*graph.input, *graph.initializer)} | {
        o for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        branch = next(a.g for a in node.attribute if a.name == "then_branch")
        given = {o.name: t for o, t in zip(branch.output, node.output, strict=True)}
        defined = [t.name for t in branch.initializer] + [o for n in branch.node for o in n.output]
        renamed = {name: given.get(name) or _unique(name, values) for name in defined if name}
        for tensor in branch.initializer:
            tensor.name = renamed[tensor.name]
        graph.initializer.extend(branch.initializer)
        for inner in branch.node:
            _rename(inner.input, renamed)
            _rename(inner.output, renamed)
            for nested in subgraphs(inner):  # (what they read from the branch, not their own)
                own = {o for n in all_nodes(nested) for o in n.output}
                for n in all_nodes(nested):
                    _rename(n.input, {k: v for k, v in renamed.items() if k not in own})
            inner.name = _unique(inner.name, names) if inner.name else inner.name
            nodes.append(inner)
        nodes += [onnx.helper.make_node("Identity", [name], [target])
                  for name, target in given.items() if name not in renamed]
    del graph.node[:]
    graph.node.extend(nodes)
    return out


def _rename(field, renamed: dict[str, str]) -> None:
    for i, name in enumerate(field):
        field[i] = renamed.get(name, name)


def _unique(name: str, taken: set[str]) -> str:
    """``name``, or it with the first free ``_inlined{n}`` suffix; recorded as taken."""
    n, free = 0, name
    while free in taken:
        n += 1
        free = f"{name}_inlined{n}"
    taken.add(free)
    return free


def without_unread(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the main-graph nodes no output depends on (a value read
    inside a kept node's subgraph counts as read)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    needed = {o.name for o in out.graph.output}
    kept = []
    for node in reversed(out.graph.node):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(node.input)
            needed.update(name for g in subgraphs(node) for n in all_nodes(g) for name in n.input)
    del out.graph.node[:]
    out.graph.node.extend(reversed(kept))
    kept_inits = [t for t in out.graph.initializer if t.name in needed]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept_inits)
    return out


def decode_graph(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model``'s decode-step graph (module doc), or None where its Ifs do not all test
    one guard (nothing to take apart, or not a shared-cache fusion's form)."""
    guard = shared_guard(model)
    if guard is None:
        return None
    out = inline_ifs(model)
    out.graph.node.append(onnx.helper.make_node("Identity", [guard], [GUARD]))
    out.graph.output.append(onnx.helper.make_tensor_value_info(GUARD, onnx.TensorProto.BOOL, []))
    return without_unread(out)
