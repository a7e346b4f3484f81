"""The exporter's rotary embedding recognised around a GroupQueryAttention's inputs
(for rotary_fold.py): Hugging Face's ``x * cos + rotate_half(x) * sin`` on heads split from a
``[B, S, heads*D]`` projection and joined again by our lowering, possibly with the rows
gathered kept-first (lower/rows.py), or only each head's first dims rotated and the rest
concatenated as they are (a partial rotary: Phi, StableLM; GroupQueryAttention rotates as many
dims as its cos_cache has pairs), with ``rotate_half`` or the interleaved pairs of
``rotate_every_two`` (Cohere, Helium: ``rotary_interleaved``). The rotation may also come
before the heads' transpose, on ``[B, S, heads, D]`` with cos/sin ``[B, S, 1, D]`` (GPT-J,
CodeGen), and the heads need not be a plain split of one ``[B, S, heads*D]`` tensor (CodeGen's
and GPT-NeoX's heads come out of a fused QKV projection): then the kernel reads the unrotated
heads joined again (``joined``). Structure only: what cos and sin hold is proven by
evaluation in rotary_fold.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import const_ints, dims, int_attr, producer

ROTARY_MULTIPLE = 16  # onnxruntime 1.31's GroupQueryAttention rotates head sizes of 16*k only


@dataclass(frozen=True)
class Rotated:
    """One rotated tensor: ``source`` [B, S, heads*D] before its heads were split, rotated by
    ``cos`` and ``sin`` ([B, 1, S, D], or [B, S, 1, D] where ``before_transpose``); ``rows``:
    the Gather that reorders its rows before the kernel (a batched prompt on a shared cache,
    kept keys first: lower/rows.py), or None; ``norm``: an RMS norm over each head's D between
    the split and the rotation (Qwen3's q_norm / k_norm, a SimplifiedLayerNormalization on
    [B, S, heads, D]), or None: then the kernel reads its output with the heads joined again
    (``joined``), not ``source``. ``source`` is None where the heads are not a plain split
    of one tensor: then the kernel reads ``heads`` (unrotated, [B, heads, S, D] or
    [B, S, heads, D]) joined again."""

    source: ir.Value | None
    cos: ir.Value
    sin: ir.Value
    rows: ir.Node | None = None
    norm: ir.Node | None = None
    interleaved: bool = False  # pairs (x0, x1), (x2, x3), ... rotated (rotate_every_two)
    heads: ir.Value | None = None
    before_transpose: bool = False  # rotated on [B, S, heads, D] (GPT-J, CodeGen)


def rotated(value: ir.Value | None, heads: int) -> Rotated | None:
    """``value`` = Reshape(Transpose(x * cos + rotate_half(x) * sin)) with x the heads of a
    [B, S, heads*D] tensor split to [B, heads, S, D] (or Reshape(Transpose(Transpose(...)))
    with x [B, S, heads, D]: rotated before the heads' transpose), or its rows gathered
    (Gather on the rows of Reshape(it, [-1, C])); None otherwise."""
    rows = producer(value, "Gather")
    flat = producer(rows.inputs[0], "Reshape") if rows is not None else None
    if rows is not None:
        if flat is None or int_attr(rows, "axis", 0) != 0:
            return None
        inner = rotated(flat.inputs[0], heads)
        return None if inner is None or inner.rows is not None else replace(inner, rows=rows)
    joined = producer(value, "Reshape")
    back = producer(joined.inputs[0], "Transpose") if joined is not None else None
    rotated_heads = back.inputs[0] if back is not None and _swaps(back) else None
    first_back = producer(rotated_heads, "Transpose")
    before = first_back is not None and _swaps(first_back)  # (GPT-J: [B, S, heads, D])
    if before:
        rotated_heads = first_back.inputs[0]
    partial = _partial(rotated_heads)
    add = producer(partial[0] if partial else rotated_heads, "Add")
    if add is None or const_ints(joined.inputs[1]) not in ([0, 0, -1], None):
        return None
    for plain, turned in (add.inputs, add.inputs[::-1]):
        first, second = producer(plain, "Mul"), producer(turned, "Mul")
        if first is None or second is None:
            continue
        for x, cos in (first.inputs, first.inputs[::-1]):
            found = _source(x, heads, partial, before)
            if found is None:
                continue
            for half, sin in (second.inputs, second.inputs[::-1]):
                for turned_by, interleaved in ((_rotate_half, False), (_rotate_every_two, True)):
                    if turned_by(half, x):
                        return replace(found, cos=cos, sin=sin, interleaved=interleaved)
    return None


def _source(x: ir.Value, heads: int, partial: tuple[ir.Value, ir.Value, int] | None,
            before: bool) -> Rotated | None:
    """What the kernel reads for the rotated ``x`` (cos/sin not filled in yet): the
    [B, S, heads*D] tensor its heads were split from, the heads after an RMS norm, or,
    where neither, the unrotated heads themselves; None where ``x`` is not a head's
    rotated part."""
    if partial:  # x: the first rotary_dim of each head, the rest passed as it is
        if not _rotary_part(x, partial):
            return None
        x, norm = partial[1], None
        source = _split_heads(x, heads, before=before)
    else:
        source, norm = _split_heads(x, heads, before=before), None
        if source is None and not before:
            source, norm = _normed_heads(x, heads) or (None, None)
    if source is None and norm is None:
        shape = dims(x)
        if shape is None or len(shape) != 4 or shape[2 if before else 1] != heads \
                or not isinstance(shape[3], int) or shape[3] % ROTARY_MULTIPLE \
                or x.producer() is None:  # (joined puts its nodes after x's producer)
            return None
        return Rotated(None, x, x, heads=x, before_transpose=before)
    return Rotated(source, x, x, norm=norm, before_transpose=before)


def joined(found: Rotated) -> ir.Value:
    """What the kernel reads: ``source``, or the norm's output or the unrotated heads with
    the heads joined again (a Reshape to [B, S, heads*D], after a Transpose where the heads
    are [B, heads, S, D]), put right after what it reads."""
    if found.norm is None and found.source is not None:
        return found.source
    tape = ir.tape.Tape()
    after = found.norm if found.norm is not None else found.heads.producer()
    heads = found.norm.outputs[0] if found.norm is not None else found.heads
    shape = dims(heads)
    if found.norm is None and not found.before_transpose:
        heads = tape.op("Transpose", [heads], {"perm": [0, 2, 1, 3]})
        heads.type = found.heads.type
        heads.shape = ir.Shape([shape[0], shape[2], shape[1], shape[3]])
    flat = tape.op("Reshape", [heads, tape.op("Constant", [], {"value": ir.tensor(
        np.array([0, 0, -1], np.int64))})])
    if found.norm is not None:
        flat.type, flat.shape = found.source.type, found.source.shape
    else:
        flat.type = found.heads.type
        rows = shape[1] if found.before_transpose else shape[2]
        flat.shape = ir.Shape([shape[0], rows, shape[2 if found.before_transpose else 1]
                               * shape[3]])
    after.graph.insert_after(after, tape.nodes)
    return flat


def _partial(value: ir.Value | None) -> tuple[ir.Value, ir.Value, int] | None:
    """For ``Concat(rotated, heads[..., r:])`` on the last axis (a partial rotary: Phi's and
    StableLM's ``partial_rotary_factor``), r a width the kernel rotates (16k): (rotated,
    heads, r); None otherwise."""
    cat = producer(value, "Concat")
    if cat is None or len(cat.inputs) != 2 or int_attr(cat, "axis", 0) not in (-1, 3):
        return None
    passed = producer(cat.inputs[1], "Slice")
    heads = passed.inputs[0] if passed is not None else None
    width = (dims(heads) or [None] * 4)[3] if heads is not None else None
    rotated_width = (dims(cat.inputs[0]) or [None] * 4)[3]
    if not isinstance(width, int) or not isinstance(rotated_width, int) or not (
            0 < rotated_width < width) or rotated_width % ROTARY_MULTIPLE:
        return None
    if not _half(cat.inputs[1], heads, rotated_width, width, width):
        return None
    return cat.inputs[0], heads, rotated_width


def _rotary_part(x: ir.Value, partial: tuple[ir.Value, ir.Value, int]) -> bool:
    """``x`` = heads[..., :r] of the partial rotary's heads."""
    _, heads, width = partial
    full = (dims(heads) or [None] * 4)[3]
    return isinstance(full, int) and _half(x, heads, 0, width, full)


def _swaps(node: ir.Node) -> bool:
    perm = node.attributes.get("perm")
    return perm is not None and list(perm.value) == [0, 2, 1, 3]


def _normed_heads(x: ir.Value, heads: int) -> tuple[ir.Value, ir.Node] | None:
    """(the [B, S, heads*D] tensor, the norm) where ``x`` [B, heads, S, D] is its heads split
    and RMS-normalised over D (SimplifiedLayerNormalization on the last axis, a weight of
    D values: each head's vector on its own, as before the rotation), then transposed."""
    swap = producer(x, "Transpose")
    norm = producer(swap.inputs[0], "SimplifiedLayerNormalization") \
        if swap is not None and _swaps(swap) else None
    if norm is None or norm.domain not in ("", "ai.onnx") or len(norm.outputs) != 1 \
            or int_attr(norm, "axis", -1) not in (-1, 3):
        return None
    width = (dims(x) or [None] * 4)[3]
    weight = dims(norm.inputs[1]) if len(norm.inputs) > 1 else None
    if weight != [width]:
        return None
    split = producer(norm.inputs[0], "Reshape")
    source = _split_heads(x, heads, split) if split is not None else None
    return None if source is None else (source, norm)


def _split_heads(x: ir.Value, heads: int, split: ir.Node | None = None,
                 before: bool = False) -> ir.Value | None:
    """The [B, S, heads*D] tensor ``x`` [B, heads, S, D] (``before``: [B, S, heads, D]) was
    split from, if it was (``split``: the Reshape that split it, where something lies
    between it and the Transpose)."""
    if before:
        split = producer(x, "Reshape")
    elif split is None:
        swap = producer(x, "Transpose")
        split = producer(swap.inputs[0], "Reshape") if swap is not None and _swaps(swap) \
            else None
    shape = dims(x)
    if split is None or shape is None or len(shape) != 4 or shape[2 if before else 1] != heads:
        return None
    source = split.inputs[0]
    before = dims(source)
    width = shape[3]
    if (not isinstance(width, int) or width % ROTARY_MULTIPLE or before is None
            or len(before) != 3
            or before[2] != heads * width):
        return None
    return source


def _rotate_half(value: ir.Value, x: ir.Value) -> bool:
    """``value`` = Concat(-x[..., D/2:], x[..., :D/2]) on the last axis."""
    cat = producer(value, "Concat")
    width = (dims(x) or [None] * 4)[3]
    if cat is None or len(cat.inputs) != 2 or int_attr(cat, "axis", 0) not in (-1, 3):
        return False
    neg = producer(cat.inputs[0], "Neg")
    if neg is None or not isinstance(width, int):
        return False
    return (_half(neg.inputs[0], x, width // 2, width, width)
            and _half(cat.inputs[1], x, 0, width // 2, width))


def _rotate_every_two(value: ir.Value, x: ir.Value) -> bool:
    """``value`` = stack(-x[..., 1::2], x[..., 0::2], -1) flattened to x's shape again (the
    interleaved rotation: GPT-J's rotate_every_two, Cohere's, GLM's and Helium's)."""
    flat = producer(value, "Reshape")
    cat = producer(flat.inputs[0], "Concat") if flat is not None else None
    width = (dims(x) or [None] * 4)[3]
    if (cat is None or len(cat.inputs) != 2 or not isinstance(width, int)
            or dims(value) != dims(x) or int_attr(cat, "axis", 0) not in (-1, 4)):
        return False
    parts = [producer(v, "Unsqueeze") for v in cat.inputs]
    if any(p is None or const_ints(p.inputs[1]) not in ([-1], [4]) for p in parts):
        return False
    neg = producer(parts[0].inputs[0], "Neg")
    return (neg is not None and _half(neg.inputs[0], x, 1, width, width, step=2)
            and _half(parts[1].inputs[0], x, 0, width, width, step=2))


def _half(value: ir.Value | None, x: ir.Value, start: int, end: int, width: int,
          step: int = 1) -> bool:
    """``value`` = x[..., start:end:step] (a Slice on the last axis; an end past D counts as
    D)."""
    node = producer(value, "Slice")
    if node is None or node.inputs[0] is not x or len(node.inputs) < 4:
        return False
    starts, ends, axes = (const_ints(v) for v in node.inputs[1:4])
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 else [1]
    if None in (starts, ends, axes) or axes not in ([-1], [3]) or steps != [step]:
        return False
    return starts == [start] and (ends == [end] or (end == width and ends[0] >= width))


def unsplit(value: ir.Value | None, heads: int) -> ir.Value | None:
    """The [B, S, heads*D] tensor ``value`` is, its heads split and joined again by layout
    ops (and its rows perhaps gathered, see Rotated.rows); None where it is not that."""
    rows = producer(value, "Gather")
    if rows is not None:
        flat = producer(rows.inputs[0], "Reshape")
        value = flat.inputs[0] if flat is not None and int_attr(rows, "axis", 0) == 0 else None
    joined = producer(value, "Reshape")
    back = producer(joined.inputs[0], "Transpose") if joined is not None else None
    if back is None or not _swaps(back) or const_ints(joined.inputs[1]) not in ([0, 0, -1], None):
        shape = dims(value) if rows is not None else None  # gathered rows of [B, S, H*D]
        return value if shape is not None and len(shape) == 3 else None
    return _split_heads(back.inputs[0], heads)
