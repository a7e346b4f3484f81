"""Attention written with Einsums, as 4-D MatMuls over every other axis stacked on the batch.

LongT5's local attention (and its transient-global kin) splits the sequence into blocks and
keeps one more axis than attention kernels take: Q [B, nb, bl, H, D], K and V [B, nb, kl, H,
D] (each block's keys: itself and its neighbours), and writes the products as Einsums::

    s = Einsum("...qhd,...khd->...hqk", Q, K)          # [B, nb, H, bl, kl]
    p = Softmax(s + m)                                  # m: position bias + local mask
    o = Einsum("...hqk,...khd->...qhd", p, V)          # [B, nb, bl, H, D]

Each block is an attention of its own, so with the axes that are neither the heads nor the
queries, keys or head size merged into one batch (``B' = B * nb``) the same values are
``Q'·K'^T`` and ``p'·V'`` with Q' [B', H, bl, D], K'^T [B', H, D, kl], V' [B', H, kl, D]:
Transposes and Reshapes only move elements, and each score is the same sum over ``d`` (up
to the kernels' summation order). The masks added on the scores are expanded over them and
moved the same way, so the recogniser reads an ordinary block with an additive bias. The
heads are the one axis every operand shares whose size is fixed (Pegasus-X writes its
blocks after the heads, ``BHNKF``: the blocks join the batch there too).

Pegasus-X's local attention also reads global tokens beside each block: the scores against
the global keys (one Einsum, broadcast over the blocks) and against the block's keys (a
second) concatenated before the Softmax, the weights sliced apart for their two values and
the two products added. That is one attention over the keys concatenated (the global ones
expanded over the blocks) and the values likewise: :func:`_join_keys` writes it so first.

Only a block made of those Einsums, Adds, Casts and one Softmax over its keys is rewritten;
anything else between them leaves it as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.optimizer import remove_unused_nodes

from mha_onnx.rewrite.irutil import all_graphs, const_ints, dims, int_attr, take_output

_STEPS = ("Add", "Cast")
BLOCKED_NOTE = ("{n} attention(s) written as Einsums (LongT5's local attention over 5-D blocks, "
                "Pegasus-X's) made 4-D MatMuls, every axis but heads, queries, keys and head "
                "size merged into the batch")
MERGED = "batch_x_blocks"  # the batch dims of the merged tensors (batch times blocks), _n
_ELLIPSIS = "0123456789"  # letters standing for the axes an equation's ``...`` covers


def blocked_einsums(model: ir.Model) -> int:
    """Every Q·K^T Einsum whose scores reach a weights-times-V Einsum through Adds, Casts and
    one Softmax, rewritten as 4-D MatMuls (joined keys first); returns how many blocks."""
    joined = [_join_keys(graph, node) for graph in all_graphs(model.graph)
              for node in list(graph) if node.op_type == "Concat" and node.graph is graph]
    if any(joined):
        remove_unused_nodes(model)  # the slices and products the joined ones replace
    done = 0
    for graph in all_graphs(model.graph):
        for node in list(graph):
            if _is_einsum(node):
                found = _block(node)
                if found is not None:
                    done += 1
                    _rewrite(graph, node, *found, merged=f"{MERGED}_{done}")
    return done


def _is_einsum(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "Einsum" and node.domain in ("", "ai.onnx") \
        and len(node.inputs) == 2


def _equation(node: ir.Node) -> tuple[str, str, str] | None:
    """The letters of each operand and the output, ``...`` written out as digits (both
    operands' of one rank), no letter twice in one term."""
    equation = node.attributes.get("equation")
    if equation is None:
        return None
    text = equation.as_string().replace(" ", "")
    if "->" not in text or text.count(",") != 1:
        return None
    left, out = text.split("->")
    terms = [*left.split(","), out]
    if "..." in text:
        ranks = [len(dims(v) or []) for v in node.inputs]  # (0: unknown)
        spans = {r - len(t.replace("...", "")) for r, t in zip(ranks, terms, strict=False) if r}
        if len(spans) != 1 or not all("..." in t for t in terms):
            return None
        span = spans.pop()
        terms = [t.replace("...", _ELLIPSIS[:span]) for t in terms]
    if any(len(set(t)) != len(t) for t in terms):
        return None
    return terms[0], terms[1], terms[2]


def _roles(node: ir.Node, terms, heads: str | None = None
           ) -> tuple[str, str, str, str, str] | None:
    """(batch letters, heads, a's own, b's own, contracted) of a product ``a, b -> out``:
    one letter each of a's own, b's own and contracted; the heads the last shared axis whose
    size is fixed; the other shared axes the batch, in the output's order."""
    a, b, out = terms
    contracted = [c for c in a if c in b and c not in out]
    own_a = [c for c in a if c in out and c not in b]
    own_b = [c for c in b if c in out and c not in a]
    shared = [c for c in out if c in a and c in b]
    if len(contracted) != 1 or len(own_a) != 1 or len(own_b) != 1 \
            or len(a) + len(b) + len(out) != 3 * len(shared) + 6:
        return None
    if heads is None:  # (the weights' Einsum: the scores')
        size = dims(node.inputs[0])
        fixed = [c for c in shared if size is not None and isinstance(size[a.index(c)], int)]
        if not fixed:
            return None
        heads = fixed[-1]
    if heads not in shared:
        return None
    return "".join(c for c in shared if c != heads), heads, own_a[0], own_b[0], contracted[0]


def _block(qk: ir.Node):
    """(roles, the chain of Adds/Casts/Softmax/Casts, the V Einsum, its letters renamed to
    the scores', V's head-size letter) when ``qk`` is Q·K^T of a block whose weights reach V
    through an Einsum that keeps the batch, heads and query axes in the scores' order; None
    otherwise."""
    terms = _equation(qk)
    roles = _roles(qk, terms) if terms else None
    if roles is None or terms[2][-1] != roles[3]:  # the Softmax's axis: the keys, last
        return None
    chain, value, softmax = [], qk.outputs[0], None
    while True:
        users = value.uses()
        if len(users) != 1 or value.is_graph_output():
            return None
        user = users[0][0]
        if _is_einsum(user) and softmax is not None and user.inputs[0] is value:
            break
        if user.op_type == "Softmax" and softmax is None:
            if int_attr(user, "axis", -1) not in (-1, len(terms[2]) - 1):
                return None
            softmax = user
        elif user.op_type not in _STEPS or (user.op_type == "Add" and softmax is not None):
            return None
        chain.append(user)
        value = user.outputs[0]
    pv_terms = _equation(user)
    if pv_terms is None or len(pv_terms[0]) != len(terms[2]):
        return None
    rename = dict(zip(pv_terms[0], terms[2], strict=True))  # the weights' letters -> scores'
    if any(c in terms[2] for c in pv_terms[1] + pv_terms[2] if c not in rename):
        return None  # V's own letter reads like one of the scores' axes once renamed
    batch, heads, q, k, _ = roles
    pv_roles = _roles(user, (terms[2], "".join(rename.get(c, c) for c in pv_terms[1]),
                             "".join(rename.get(c, c) for c in pv_terms[2])), heads)
    if pv_roles is None or pv_roles[:3] != (batch, heads, q) or pv_roles[4] != k:
        return None  # the weights' keys contracted with V's, the other axes kept
    return roles, chain, user, rename, pv_roles[3]


def _rewrite(graph: ir.Graph, qk: ir.Node, roles, chain, pv: ir.Node, rename, dv: str, *,
             merged: str) -> None:
    """The block as MatMuls over [``merged``, H, ..] (a batch dim named for this block:
    ORT reuses buffers across values whose dims share a name)."""
    tape = ir.tape.Tape()
    a, b, out = _equation(qk)  # type: ignore[misc]
    batch, heads, q, k, d = roles
    query, key = qk.inputs
    q4 = _merged(tape, query, a, batch + q + heads + d, merged)  # [B', H, q, D]
    kt = _merged(tape, key, b, batch + k + heads + d, merged, key=True)  # [B', H, D, k]
    scores = _like(tape.op("MatMul", [q4, kt]), q4, kt)
    value, old = scores, qk.outputs[0]
    for step in chain:
        if step.op_type == "Add":
            mask = step.inputs[1] if step.inputs[0] is old else step.inputs[0]
            bias = _bias(tape, mask, (query, a), (key, b), out, roles)
            value = _like(tape.op("Add", [value, bias]), value)
        elif step.op_type == "Softmax":  # over the keys, the last axis of either rank
            value = _like(tape.op("Softmax", [value], {"axis": -1}), value)
            value.producer().name, step.name = step.name, f"{step.name}@einsum"  # the block's
        else:
            to = step.attributes["to"].value
            value = _like(tape.op("Cast", [value], {"to": to}), value, dtype=ir.DataType(to))
        old = step.outputs[0]
    back = {v: c for c, v in rename.items()}  # scores' letters -> the V Einsum's
    _, vb, vout = _equation(pv)  # type: ignore[misc]
    v_letters = "".join(rename.get(c, c) for c in vb)
    v4 = _merged(tape, pv.inputs[1], v_letters, batch + k + heads + dv, merged)  # [B', H, k, Dv]
    out4 = _like(tape.op("MatMul", [value, v4]), value, v4)  # [B', H, q, D]
    rows = tape.op("Transpose", [out4], {"perm": [0, 2, 1, 3]})  # [B', q, H, D]: as a kernel
    unmerged = tape.op("Reshape", [rows, tape.op("Concat", [  # writes it (Transposes cancel)
        _picked(tape, tape.op("Shape", [query]), [a.index(c) for c in batch]),
        tape.op("Shape", [rows], {"start": 1})], {"axis": 0})])
    layout = [back.get(c, c) for c in batch + q + heads + dv]
    result = tape.op("Transpose", [unmerged], {"perm": [layout.index(c) for c in vout]})
    if pv.outputs[0].dtype is not None:
        result.dtype, result.shape = pv.outputs[0].dtype, pv.outputs[0].shape
    graph.insert_before(pv, tape.nodes)
    take_output(graph, pv.outputs[0], result, "einsum")
    ir.convenience.replace_all_uses_with(pv.outputs[0], result)


def _merged(tape: ir.tape.Tape, x: ir.Value, axes: str, order: str, name: str, *,
            key: bool = False) -> ir.Value:
    """``x`` (axes named ``axes``) moved to ``order`` (the batch axes, then sequence, heads,
    head size), the batch axes merged: [B', S, H, D], then as attention reads it: [B', H,
    S, D], or K^T [B', H, D, S] (``key``). The last Transpose is what a kernel's lowering
    undoes, so that only the first one moves data."""
    moved = tape.op("Transpose", [x], {"perm": [axes.index(c) for c in order]})
    flat = tape.op("Reshape", [moved, tape.op("Concat", [
        _ints(tape, [-1]), tape.op("Shape", [moved], {"start": len(order) - 3})], {"axis": 0})])
    out = tape.op("Transpose", [flat], {"perm": [0, 2, 3, 1] if key else [0, 2, 1, 3]})
    shape = dims(x)
    if x.dtype is not None and shape is not None:  # the recogniser reads the heads and head
        seq, heads, dim = (shape[axes.index(c)] for c in order[-3:])  # size from these
        flat.dtype, flat.shape = x.dtype, ir.Shape([name, seq, heads, dim])
        out.dtype, out.shape = x.dtype, ir.Shape([name, heads, dim, seq] if key
                                                 else [name, heads, seq, dim])
    return out


def _bias(tape: ir.tape.Tape, mask: ir.Value, q_side, k_side, out: str, roles) -> ir.Value:
    """``mask`` (added on the scores laid out as ``out``) expanded over them and moved to the
    merged scores' [B', H, q, k]; [B', 1, q, k] where it is one for every head (as the
    original broadcast it), not copied per head."""
    batch, heads, q, k, _ = roles
    (query, a), (key, b) = q_side, k_side
    md = dims(mask)
    pad = len(out) - len(md) if md is not None else 0
    at = out.index(heads) - pad
    one_head = md is not None and pad >= 0 and (at < 0 or md[at] == 1)
    sizes = tape.op("Concat", [tape.op("Shape", [query]), tape.op("Shape", [key]),
                               _ints(tape, [1])], {"axis": 0})
    whole = _picked(tape, sizes, [len(a) + len(b) if one_head and c == heads
                                  else a.index(c) if c in a else len(a) + b.index(c)
                                  for c in out])
    moved = tape.op("Transpose", [tape.op("Expand", [mask, whole])],
                    {"perm": [out.index(c) for c in batch + heads + q + k]})
    shape4 = tape.op("Concat", [_ints(tape, [-1]), _picked(tape, sizes, [
        len(a) + len(b) if one_head else a.index(heads), a.index(q), len(a) + b.index(k)])],
        {"axis": 0})  # (sizes read from Q and K, not from the scores: they stay unmade)
    return tape.op("Reshape", [moved, shape4])


def _picked(tape: ir.tape.Tape, shape: ir.Value, indices: list[int]) -> ir.Value:
    """The dims of ``shape`` at ``indices`` (an empty list: none, [0] int64)."""
    if not indices:
        return tape.op("Constant", [], {"value": ir.tensor(np.zeros(0, np.int64))})
    return tape.op("Gather", [shape, _ints(tape, indices)], {"axis": 0})


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


# -- Pegasus-X: global keys beside each block's, joined into one attention -------------------

def _join_keys(graph: ir.Graph, concat: ir.Node) -> bool:
    """``Concat(Q·Kg^T, Q·Kl^T)`` on the keys' axis, its Softmax's weights sliced at the
    join for ``·Vg`` and ``·Vl`` added: rewritten as ``Q·[Kg; Kl]^T`` and ``·[Vg; Vl]``
    (Kg, Vg expanded over the axes they lack). Returns whether it did."""
    found = _joined(concat)
    if found is None:
        return False
    (glob, local), (left, right), (pv_glob, pv_local), add = found
    tape = ir.tape.Tape()
    a, b_local, out = _equation(local)  # type: ignore[misc]
    key_axis = b_local.index(out[-1])
    keys = tape.op("Concat", [_spread(tape, glob, local, out[-1]), local.inputs[1]],
                   {"axis": key_axis})
    scores = tape.op("Einsum", [local.inputs[0], keys],
                     {"equation": local.attributes["equation"].as_string()})
    _, v_local, _ = _equation(pv_local)  # type: ignore[misc]
    joined_key = _equation(pv_local)[0][-1]  # type: ignore[index]
    values = tape.op("Concat", [_spread(tape, pv_glob, pv_local, joined_key), pv_local.inputs[1]],
                     {"axis": v_local.index(joined_key)})
    weights = left.inputs[0]
    joined = tape.op("Einsum", [weights, values],
                     {"equation": pv_local.attributes["equation"].as_string()})
    g_terms, pg_terms = _equation(glob), _equation(pv_glob)
    _joined_shape(keys, local.inputs[1], glob.inputs[1], key_axis,
                  g_terms[1].index(g_terms[2][-1]))  # type: ignore[index]
    _joined_shape(values, pv_local.inputs[1], pv_glob.inputs[1], v_local.index(joined_key),
                  pg_terms[1].index(pg_terms[0][-1]))  # type: ignore[index]
    for new, old in ((scores, concat.outputs[0]), (joined, add.outputs[0])):
        if old.dtype is not None:
            new.dtype, new.shape = old.dtype, old.shape
    graph.insert_before(add, tape.nodes)
    ir.convenience.replace_all_uses_with(concat.outputs[0], scores)
    take_output(graph, add.outputs[0], joined, "joined")
    ir.convenience.replace_all_uses_with(add.outputs[0], joined)
    return True


def _joined_shape(new: ir.Value, local: ir.Value, small: ir.Value, axis: int, width_axis: int
                  ) -> None:
    """``new`` (the local keys or values with ``small``'s before them on ``axis``) typed as
    the local ones, that axis the sum of both lengths where both are known."""
    shape, small_dims = dims(local), dims(small)
    if shape is None or local.dtype is None:
        return
    width = small_dims[width_axis] if small_dims is not None else None
    shape = list(shape)
    shape[axis] = shape[axis] + width if isinstance(shape[axis], int) \
        and isinstance(width, int) else None
    new.dtype, new.shape = local.dtype, ir.Shape(shape)


def _joined(concat: ir.Node):
    """The parts of a joined-keys attention at ``concat`` (see :func:`_join_keys`)."""
    if len(concat.inputs) != 2 or not all(_is_einsum(v.producer()) for v in concat.inputs):
        return None
    glob, local = (v.producer() for v in concat.inputs)
    if glob.inputs[0] is not local.inputs[0]:
        return None
    terms = _equation(local)
    if terms is None or _roles(local, terms) is None or terms[2][-1] not in terms[1] \
            or int_attr(concat, "axis", 0) not in (-1, len(terms[2]) - 1):
        return None
    split = dims(glob.inputs[1])
    g_terms = _equation(glob)
    if g_terms is None or split is None or g_terms[2][:-1] != terms[2][:-1] \
            or g_terms[0] != terms[0] or not set(g_terms[1]) - {g_terms[2][-1]} <= set(terms[1]):
        return None
    width = split[g_terms[1].index(g_terms[2][-1])]
    softmax = _only_user(_after_adds(concat.outputs[0]), "Softmax")
    if softmax is None or not isinstance(width, int):
        return None
    slices = [u for u, _ in softmax.outputs[0].uses()]
    if len(slices) != 2 or not all(s.op_type == "Slice" for s in slices):
        return None
    left, right = sorted(slices, key=lambda s: (const_ints(s.inputs[1]) or [1 << 62])[0])
    last = ([-1], [len(terms[2]) - 1])
    if const_ints(left.inputs[1]) != [0] or const_ints(left.inputs[2]) != [width] \
            or const_ints(right.inputs[1]) != [width] or any(
                len(s.inputs) < 4 or const_ints(s.inputs[3]) not in last
                or (len(s.inputs) > 4 and const_ints(s.inputs[4]) != [1]) for s in slices):
        return None  # the weights cut on the keys' axis at the join
    pvs = [_only_user(s.outputs[0], "Einsum") for s in (left, right)]
    if not all(pvs) or any(
            p.inputs[0] is not s.outputs[0] for p, s in zip(pvs, (left, right), strict=True)):
        return None
    pg, pl = _equation(pvs[0]), _equation(pvs[1])
    if pg is None or pl is None or pg[2] != pl[2] or pg[0][:-1] != pl[0][:-1] \
            or pg[0][-1] in pl[0] or not set(pg[1]) - {pg[0][-1]} <= set(pl[1]):
        return None  # each part's weights times its values over its own keys, alike
    add = _only_user(pvs[0].outputs[0], "Add")
    if add is None or _only_user(pvs[1].outputs[0], "Add") is not add:
        return None
    return (glob, local), (left, right), (pvs[0], pvs[1]), add


def _after_adds(value: ir.Value) -> ir.Value:
    """``value`` past the Adds and Casts that follow it alone (the masks)."""
    while True:
        user = _only_user(value, "Add") or _only_user(value, "Cast")
        if user is None:
            return value
        value = user.outputs[0]


def _only_user(value: ir.Value, op_type: str) -> ir.Node | None:
    users = value.uses()
    if len(users) != 1 or users[0][0].op_type != op_type or value.is_graph_output():
        return None
    return users[0][0]


def _spread(tape: ir.tape.Tape, small: ir.Node, like: ir.Node, key: str) -> ir.Value:
    """``small``'s second operand laid out as ``like``'s: its axes moved to ``like``'s
    order (its keys, the one axis ``like`` names ``key`` and ``small`` otherwise, in their
    place), the axes it lacks added and expanded to the sizes of ``like``'s."""
    s_terms, l_terms = _equation(small), _equation(like)
    s_own, l_own = s_terms[1], l_terms[1]  # type: ignore[index]
    theirs = [c for c in s_own if c not in l_own]
    if len(theirs) != 1:
        raise ValueError("not one joined axis")  # (checked by _joined)
    named = s_own.replace(theirs[0], key)
    present = [c for c in l_own if c in named]
    x = tape.op("Transpose", [small.inputs[1]], {"perm": [named.index(c) for c in present]})
    missing = [i for i, c in enumerate(l_own) if c not in named]
    if not missing:
        return x
    x = tape.op("Unsqueeze", [x, _ints(tape, missing)])
    sizes = [_picked(tape, tape.op("Shape", [like.inputs[1]]), [i]) if i in missing
             else _ints(tape, [1]) for i in range(len(l_own))]
    return tape.op("Expand", [x, tape.op("Concat", sizes, {"axis": 0})])
