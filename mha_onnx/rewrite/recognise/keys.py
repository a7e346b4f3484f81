"""K and V as an attention core takes them: the form K arrives in (transposed three ways) and
grouped K/V (heads repeated by Unsqueeze/Expand/Reshape, or broadcast by the MatMul itself).

Dims: B batch, H query heads, G K/V heads, T key length, D head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from mha_onnx.rewrite.irutil import const_ints, dims, ints_attr, producer, same_dim


def key_from_transposed(kt: ir.Value, rank: int) -> tuple[ir.Value, str]:
    """K as [B, H, T, D] ("bhtd"), its [B, T, H, D] source ("bthd"), or K^T itself ("kt")."""
    node = producer(kt, "Transpose")
    if node is not None:
        perm = ints_attr(node, "perm")
        if rank == 4 and perm == [0, 1, 3, 2]:
            return node.inputs[0], "bhtd"
        if rank == 4 and perm == [0, 2, 3, 1]:
            return node.inputs[0], "bthd"
        if rank == 3 and perm == [0, 2, 1]:
            return node.inputs[0], "bhtd"
    node = producer(kt, "Reshape")
    if node is not None and rank == 4:
        inner = producer(node.inputs[0], "Transpose")
        flat = producer(inner.inputs[0], "Reshape") if inner is not None else None
        if flat is not None and ints_attr(inner, "perm") == [0, 2, 1]:  # type: ignore[arg-type]
            k4 = flat.inputs[0]
            kd, ktd = dims(k4), dims(kt)
            if (kd is not None and ktd is not None and len(kd) == 4
                    and all(same_dim(kd[a], ktd[b]) for a, b in ((0, 0), (1, 1), (2, 3), (3, 2)))):
                return k4, "bhtd"
    return kt, "kt"


def key_dims(key: ir.Value, form: str, kt: ir.Value, rank: int) -> list | None:
    """K's dims in [B, H, T, D] order (rank 3: [N, T, D]), whichever form K was found in."""
    if form == "bhtd":
        kd = dims(key)
    elif form == "bthd":
        src = dims(key)
        kd = None if src is None or len(src) != 4 else [src[0], src[2], src[1], src[3]]
    else:
        src = dims(kt)
        kd = None if src is None else src[:-2] + [src[-1], src[-2]]
    return kd if kd is not None and len(kd) == rank else None


@dataclass(frozen=True)
class Grouped:
    """K or V with fewer heads than Q: ``source`` [B, G, T, D] repeated to [B, H, T, D]."""

    source: ir.Value
    kv_heads: int


def repeated_heads(x4: ir.Value, heads: int) -> Grouped | None:
    """``Reshape(Expand(Unsqueeze(x, 2), [B, G, H/G, T, D]), [B, H, T, D])``: each of the G
    K/V heads serves H/G consecutive query heads (Hugging Face's ``repeat_kv``)."""
    reshape = producer(x4, "Reshape")
    expand = producer(reshape.inputs[0], "Expand") if reshape is not None else None
    unsq = producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
    if unsq is None or const_ints(unsq.inputs[1]) not in ([2], [-3]):
        return None
    src, wide, out = dims(unsq.inputs[0]), dims(expand.outputs[0]), dims(x4)  # type: ignore[union-attr]
    if src is None or wide is None or out is None or len(src) != 4 or len(wide) != 5:
        return None
    groups, rep = src[1], wide[2]
    if not (isinstance(groups, int) and isinstance(rep, int) and groups * rep == heads):
        return None
    same = all(same_dim(a, b) for a, b in ((src[0], wide[0]), (src[1], wide[1]), (src[2], wide[3]),
                                           (src[3], wide[4]), (out[0], src[0]), (out[2], src[2]),
                                           (out[3], src[3])))
    return Grouped(unsq.inputs[0], groups) if same and out[1] == heads else None


def broadcast_heads(x4: ir.Value, heads: int) -> Grouped | None:
    """K/V with one head that the MatMul broadcasts over H query heads (multi-query)."""
    shape = dims(x4)
    if shape is None or len(shape) != 4 or shape[1] != 1 or heads == 1:
        return None
    return Grouped(x4, 1)
