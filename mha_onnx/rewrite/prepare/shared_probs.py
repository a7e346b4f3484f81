"""One attention's weights applied to several value tensors, as one attention.

Differential attention (transformers 5's DiffLlama, eager and SDPA alike) applies one
Softmax to two halves of V: ``P @ V1`` and ``P @ V2``, later combined as ``O1 - lambda O2``.
The weights then have two users, and a fusion that must remove them refuses the block. Since
``[P @ V1, P @ V2] = P @ [V1, V2]`` (values concatenated on their last axis), the MatMuls
become one MatMul over the concatenated values, split back: exact, and one attention call
(the head size of V doubles; MultiHeadAttention takes K and V of different head sizes).

The paper's own spelling combines the weights first, ``(P1 - lambda P2) @ V``: that is
``P1 @ V - lambda (P2 @ V)``, one attention per Softmax (:func:`distribute_combinations`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import all_graphs, const_array, dims, take_output


def merge_value_matmuls(model: ir.Model) -> int:
    """Every Softmax whose weights' (NaN guard included) only users are MatMuls taking them
    as their first input, with values of one shape but their last (static) dim: one
    MatMul, split. Returns how many."""
    merged = 0
    for graph in all_graphs(model.graph):
        for node in list(graph):
            if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
                continue
            weights = _guarded(node.outputs[0])
            users = [user for user, _ in weights.uses()]
            if len(users) < 2 or weights.is_graph_output() or not all(
                    u.op_type == "MatMul" and u.inputs[0] is weights and u.graph is graph
                    for u in users):
                continue
            sizes = _value_sizes([u.inputs[1] for u in users])
            if sizes is None:
                continue
            _merge(graph, weights, users, sizes)
            merged += 1
    return merged


def _guarded(probs: ir.Value) -> ir.Value:
    """The weights as the MatMuls read them: the Softmax output, or its NaN guard
    ``Where(IsNaN(P), c, P)`` (torch's SDPA export) when that is its one other reader."""
    for user, _ in probs.uses():
        if user.op_type == "Where" and user.inputs[2] is probs:
            test = user.inputs[0].producer() if user.inputs[0] is not None else None
            if test is not None and test.op_type == "IsNaN" and test.inputs[0] is probs:
                return user.outputs[0]
    return probs


def _value_sizes(values: list[ir.Value]) -> list[int] | None:
    """The last dims of ``values`` when they agree on every other dim (and their rank)."""
    shapes = [dims(v) for v in values]
    if any(s is None or len(s) < 2 or not isinstance(s[-1], int) for s in shapes):
        return None
    first = shapes[0]
    if any(len(s) != len(first) or s[:-1] != first[:-1] for s in shapes):
        return None
    return [int(s[-1]) for s in shapes]


def _merge(graph: ir.Graph, probs: ir.Value, users: list[ir.Node], sizes: list[int]) -> None:
    concat = ir.node("Concat", [u.inputs[1] for u in users], {"axis": -1})
    matmul = ir.node("MatMul", [probs, concat.outputs[0]])
    split_sizes = ir.Value(name=f"{users[0].name}_value_sizes",
                           const_value=ir.tensor(np.array(sizes, np.int64)))
    graph.register_initializer(split_sizes)
    split = ir.node("Split", [matmul.outputs[0], split_sizes], {"axis": -1},
                    num_outputs=len(users))
    graph.extend([concat, matmul, split])
    value, weights = dims(users[0].inputs[1]), dims(probs)
    concat.outputs[0].shape = ir.Shape([*value[:-1], sum(sizes)])  # type: ignore[index]
    if weights is not None:
        matmul.outputs[0].shape = ir.Shape([*weights[:-1], sum(sizes)])
    for out in (concat.outputs[0], matmul.outputs[0]):
        out.type = users[0].outputs[0].type
    for user, out in zip(users, split.outputs, strict=True):
        out.shape, out.type = user.outputs[0].shape, user.outputs[0].type
        _take_over(graph, user.outputs[0], out)
        graph.remove(user, safe=True)
    graph.sort()  # the new nodes after every value they read, before every use


def distribute_combinations(model: ir.Model) -> int:
    """``MatMul(Add|Sub(a, b), V)`` where ``a`` and ``b`` are Softmax weights, each possibly
    scaled (``Mul`` by a value whose last dim is 1, so that it scales the rows of ``W @ V``
    alike): ``Add|Sub(a' @ V * ca, b' @ V * cb)``. Returns how many were rewritten."""
    done = 0
    for graph in all_graphs(model.graph):
        for node in list(graph):
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
                continue
            combined = node.inputs[0].producer() if node.inputs[0] is not None else None
            if combined is None or combined.op_type not in ("Add", "Sub") \
                    or len(node.inputs[0].uses()) != 1:
                continue
            terms = [_scaled_weights(x) for x in combined.inputs]
            if None in terms:
                continue
            parts = []
            for weights, scale in terms:  # type: ignore[misc]
                product = ir.node("MatMul", [weights, node.inputs[1]])
                graph.insert_before(node, product)
                part = product.outputs[0]
                if scale is not None:
                    scaled = ir.node("Mul", [part, scale])
                    graph.insert_before(node, scaled)
                    part = scaled.outputs[0]
                parts.append(part)
            result = ir.node(combined.op_type, parts)
            graph.insert_before(node, result)
            result.outputs[0].shape, result.outputs[0].type = node.outputs[0].shape, \
                node.outputs[0].type
            _take_over(graph, node.outputs[0], result.outputs[0])
            graph.remove([node, combined], safe=True)
            done += 1
    return done


def _scaled_weights(value: ir.Value | None) -> tuple[ir.Value, ir.Value | None] | None:
    """(Softmax weights, their scale or None) for W or Mul(W, c) / Mul(c, W) with c's last
    dim 1 (a scalar, a per-head lambda)."""
    if value is None:
        return None
    node = value.producer()
    if node is not None and node.op_type == "Softmax" and len(value.uses()) == 1:
        return value, None
    if node is None or node.op_type != "Mul" or len(value.uses()) != 1:
        return None
    for weights, scale in (node.inputs, node.inputs[::-1]):
        inner = weights.producer() if weights is not None else None
        shape = dims(scale)
        if shape is None and const_array(scale) is not None:  # a Constant not yet inferred
            shape = list(const_array(scale).shape)
        if inner is not None and inner.op_type == "Softmax" and len(weights.uses()) == 1 \
                and shape is not None and (not shape or shape[-1] == 1):
            return weights, scale
    return None


def _take_over(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """``new`` in place of ``old`` everywhere, as a graph output under its name too."""
    take_output(graph, old, new, "replaced")
    ir.convenience.replace_all_uses_with(old, new)
