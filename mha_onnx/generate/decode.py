"""A shared-cache decoder's decode steps without its run-time choice of form.

A model fused with ``--kv-cache shared`` runs each layer's attention inside an ``If``: the
GroupQueryAttention form when one guard (computed once per run, shared by every layer's
``If``) says the inputs allow it, the exact general form otherwise. A step through the file
as written costs more than its kernels: at 16 layers the int4 step read 1.073x of GenAI's
graph of the same weights as written and 1.010x with the branches inlined (docs/history/bench-notebook.md,
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
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

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


class InlineThenBranches(ir.passes.InPlacePass):
    """Every ``If`` of the main graph replaced by the nodes of its then branch (they read the
    outer values they read before: one value object, no names to match), what the ``If``
    gave now given by the branch; a graph output keeps its name (an Identity where the
    branch passes an outer value through). Names made unique over the model after."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        ifs = [n for n in graph if n.op_type == "If" and n.domain in ("", "ai.onnx")]
        for node in ifs:
            branch = node.attributes["then_branch"].as_graph()
            for name in list(branch.initializers):
                graph.register_initializer(branch.initializers.pop(name))
            inner = list(branch)
            branch.remove(inner)
            graph.insert_before(node, inner)
            given_values = list(branch.outputs)
            branch.outputs.clear()  # (a value is the output of one graph at a time)
            for out, given in zip(list(node.outputs), given_values, strict=True):
                if out.is_graph_output():
                    given = self._as_output(graph, node, out, given, set(inner))
                out.replace_all_uses_with(given, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            _let_go(node)
        if ifs:
            common_passes.NameFixPass()(model)
        return ir.passes.PassResult(model, modified=bool(ifs))

    @staticmethod
    def _as_output(graph: ir.Graph, node: ir.Node, out: ir.Value, given: ir.Value,
                   inlined: set) -> ir.Value:
        """``given`` under the output's name; an Identity of it where it is an outer value
        (a graph input or another output keeps its own name)."""
        if given.producer() not in inlined or given in graph.outputs:
            copy = ir.node("Identity", [given], name=f"{node.name}_passed")
            graph.insert_before(node, copy)
            given = copy.outputs[0]
        name = out.name
        out.name = None
        given.name = name
        return given


def _let_go(node: ir.Node) -> None:
    """The nodes of ``node``'s branches (the else branch, dropped with it) read nothing any
    more: outer values they read would still count them as uses, and be kept for them."""
    for attr in node.attributes.values():
        if attr.type != ir.AttributeType.GRAPH:
            continue
        for inner in attr.as_graph():
            _let_go(inner)
            for i in range(len(inner.inputs)):
                inner.replace_input_with(i, None)


def inline_ifs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every ``If`` of its main graph replaced by the nodes of its
    then branch (InlineThenBranches)."""
    graph = ir.from_proto(model)
    InlineThenBranches()(graph)
    return ir.to_proto(graph)


def without_unread(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the main-graph nodes and initializers no output depends
    on (a value read inside a kept node's subgraph counts as read)."""
    graph = ir.from_proto(model)
    common_passes.RemoveUnusedNodesPass()(graph)
    return ir.to_proto(graph)


def decode_graph(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model``'s decode-step graph (module doc), or None where its Ifs do not all test
    one guard (nothing to take apart, or not a shared-cache fusion's form)."""
    guard = shared_guard(model)
    if guard is None:
        return None
    graph = ir.from_proto(model)
    condition = next(n.inputs[0] for n in graph.graph if n.op_type == "If")
    InlineThenBranches()(graph)
    told = ir.node("Identity", [condition], name="decode_guard")
    told.outputs[0].name = GUARD
    told.outputs[0].type, told.outputs[0].shape = ir.TensorType(ir.DataType.BOOL), ir.Shape([])
    graph.graph.append(told)
    graph.graph.outputs.append(told.outputs[0])
    common_passes.RemoveUnusedNodesPass()(graph)
    return ir.to_proto(graph)
