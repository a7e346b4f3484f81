"""Attention over blocks spelt with Einsums, as 4-D MatMuls over the blocks stacked on the batch.

LongT5's local attention (and its transient-global kin) splits the sequence into blocks and
keeps one more axis than attention kernels take: Q [B, nb, bl, H, D], K and V [B, nb, kl, H,
D] (each block's keys: itself and its neighbours), and writes the products as Einsums::

    s = Einsum("...qhd,...khd->...hqk", Q, K)          # [B, nb, H, bl, kl]
    p = Softmax(s + m)                                  # m: position bias + local mask
    o = Einsum("...hqk,...khd->...qhd", p, V)          # [B, nb, bl, H, D]

Each block is an attention of its own, so with the leading axes merged into one batch
(``B' = B * nb``) the same values are ``Q'·K'^T`` and ``p'·V'`` with Q' [B', H, bl, D],
K'^T [B', H, D, kl], V' [B', H, kl, D]: Reshapes and Transposes only move elements, and
each score is the same sum over ``d`` (up to the kernels' summation order). The masks added
on the 5-D scores are expanded over them and merged the same way, so the recogniser reads
an ordinary block with an additive bias. Only the Einsums of one block are rewritten: Q·K^T,
the Adds, Casts and the Softmax over its last axis between them, and the weights' Einsum
with V; anything else between them leaves the block as it is.
"""

from __future__ import annotations

import onnx_ir as ir

from mha_onnx.rewrite.irutil import all_graphs, dims, int_attr, take_output

_STEPS = ("Add", "Cast")
BLOCKED_NOTE = ("{n} attention(s) written as Einsums (LongT5's local attention over 5-D blocks) "
                "made 4-D MatMuls, the axes before the last three merged into the batch")
MERGED = "batch_x_blocks"  # the batch dim of the merged tensors (batch times blocks)


def blocked_einsums(model: ir.Model) -> int:
    """Every Q·K^T Einsum whose scores reach a weights-times-V Einsum through Adds, Casts and
    one Softmax, rewritten as 4-D MatMuls; returns how many blocks."""
    done = 0
    for graph in all_graphs(model.graph):
        for node in list(graph):
            if node.op_type == "Einsum" and node.domain in ("", "ai.onnx"):
                found = _block(node)
                if found is not None:
                    _rewrite(graph, node, *found)
                    done += 1
    return done


def _terms(node: ir.Node) -> tuple[str, str, str] | None:
    """The three trailing axes of each operand and the output, when all share their leading
    (batch) axes, written ``...`` or the same letters."""
    equation = node.attributes.get("equation")
    if equation is None or len(node.inputs) != 2:
        return None
    text = equation.as_string().replace(" ", "")
    if "->" not in text or text.count(",") != 1:
        return None
    left, out = text.split("->")
    a, b = left.split(",")
    if any(len(t) < 3 for t in (a, b, out)) or not a[:-3] == b[:-3] == out[:-3]:
        return None
    return a[-3:], b[-3:], out[-3:]


def _roles(a: str, b: str, out: str) -> tuple[str, str, str, str] | None:
    """(shared, a's own, b's own, contracted) letters of ``a, b -> out`` over three axes."""
    if len(set(a)) != 3 or len(set(b)) != 3 or len(set(out)) != 3:
        return None
    shared = set(a) & set(b) & set(out)
    contracted = (set(a) & set(b)) - set(out)
    own_a, own_b = (set(a) & set(out)) - shared, (set(b) & set(out)) - shared
    if not all(len(s) == 1 for s in (shared, contracted, own_a, own_b)):
        return None
    return shared.pop(), own_a.pop(), own_b.pop(), contracted.pop()


def _block(qk: ir.Node):
    """(the chain of Adds/Casts/Softmax/Casts, the V Einsum) when ``qk`` is Q·K^T of a
    block whose weights reach V through an Einsum; None otherwise."""
    terms = _terms(qk)
    roles = _roles(*terms) if terms else None
    if roles is None or terms[2] != roles[0] + roles[1] + roles[2]:  # out: [.., h, q, k]
        return None
    chain, value, softmax = [], qk.outputs[0], None
    while True:
        users = value.uses()
        if len(users) != 1 or value.is_graph_output():
            return None
        user = users[0][0]
        if user.op_type == "Einsum" and softmax is not None and user.inputs[0] is value:
            break
        if user.op_type == "Softmax" and softmax is None:
            rank = len(dims(value) or []) or None
            if int_attr(user, "axis", -1) not in (-1, (rank or 0) - 1):
                return None
            softmax = user
        elif user.op_type not in _STEPS or (user.op_type == "Add" and softmax is not None):
            return None
        chain.append(user)
        value = user.outputs[0]
    pv_terms = _terms(user)
    pv_roles = _roles(*pv_terms) if pv_terms else None
    if pv_roles is None or pv_terms[0] != pv_roles[0] + pv_roles[1] + pv_roles[3]:
        return None  # the weights as [.., h, q, k], k contracted with V's keys
    return terms, chain, user, pv_terms, pv_roles


def _rewrite(graph: ir.Graph, qk: ir.Node, terms, chain, pv: ir.Node, pv_terms, pv_roles):
    tape = ir.tape.Tape()
    shared, own_q, own_k, inner = _roles(*terms)  # type: ignore[misc]
    q4 = _merged(tape, qk.inputs[0], terms[0], shared + own_q + inner)  # [B', H, q, D]
    kt = _merged(tape, qk.inputs[1], terms[1], shared + inner + own_k)  # [B', H, D, k]
    scores = _like(tape.op("MatMul", [q4, kt]), q4, kt)
    batch = tape.op("Shape", [qk.inputs[0]], {"end": -3})
    whole = tape.op("Shape", [scores], {"start": 1})
    shape5 = tape.op("Concat", [batch, whole], {"axis": 0})
    shape4 = tape.op("Concat", [_ints(tape, [-1]), whole], {"axis": 0})
    value, old = scores, qk.outputs[0]
    for step in chain:
        if step.op_type == "Add":
            mask = step.inputs[1] if step.inputs[0] is old else step.inputs[0]
            bias = tape.op("Reshape", [tape.op("Expand", [mask, shape5]), shape4])
            value = _like(tape.op("Add", [value, bias]), value)
        elif step.op_type == "Softmax":  # over the keys, the last axis of either rank
            value = _like(tape.op("Softmax", [value], {"axis": -1}), value)
            value.producer().name, step.name = step.name, f"{step.name}@einsum"  # the block's
        else:
            to = step.attributes["to"].value
            value = _like(tape.op("Cast", [value], {"to": to}), value, dtype=ir.DataType(to))
        old = step.outputs[0]
    h, q, k, d = pv_roles[0], pv_roles[1], pv_roles[3], pv_roles[2]
    v4 = _merged(tape, pv.inputs[1], pv_terms[1], h + k + d)  # [B', H, k, D]
    out4 = _like(tape.op("MatMul", [value, v4]), value, v4)  # [B', h, q, d]
    order = [(h + q + d).index(c) for c in pv_terms[2]]
    out = tape.op("Transpose", [out4], {"perm": [0, *(i + 1 for i in order)]})
    back = tape.op("Concat", [batch, tape.op("Shape", [out], {"start": 1})], {"axis": 0})
    result = tape.op("Reshape", [out, back])
    if pv.outputs[0].dtype is not None:
        result.dtype, result.shape = pv.outputs[0].dtype, pv.outputs[0].shape
    graph.insert_before(pv, tape.nodes)
    take_output(graph, pv.outputs[0], result, "einsum")
    ir.convenience.replace_all_uses_with(pv.outputs[0], result)


def _merged(tape: ir.tape.Tape, x: ir.Value, axes: str, want: str) -> ir.Value:
    """``x`` [batch.., three axes named ``axes``] -> [B', the axes in the order ``want``]."""
    flat = tape.op("Reshape", [x, tape.op("Concat", [
        _ints(tape, [-1]), tape.op("Shape", [x], {"start": -3})], {"axis": 0})])
    perm = [0, *(axes.index(c) + 1 for c in want)]
    out = tape.op("Transpose", [flat], {"perm": perm})
    shape = dims(x)
    if x.dtype is not None and shape is not None and len(shape) >= 3:  # heads, head size
        trailing = shape[-3:]  # (both typed: the recogniser reads K under its Transpose)
        flat.dtype, flat.shape = x.dtype, ir.Shape([MERGED, *trailing])
        out.dtype, out.shape = x.dtype, ir.Shape([MERGED, *(trailing[axes.index(c)] for c in want)])
    return out


def _like(new: ir.Value, a: ir.Value, b: ir.Value | None = None, *,
          dtype: ir.DataType | None = None) -> ir.Value:
    """``new`` typed as ``a`` (elementwise) or as the product ``a @ b``, where known: the
    recogniser reads the scores' rank and the heads from them."""
    if a.shape is None or a.dtype is None or (b is not None and b.shape is None):
        return new
    shape = list(a.shape) if b is None else [*list(a.shape)[:-1], list(b.shape)[-1]]
    new.dtype, new.shape = dtype or a.dtype, ir.Shape(shape)
    return new


def _ints(tape: ir.tape.Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], {"value_ints": values})
