"""What a lowering reads of a KV-cache layer and what it returns.

A layer's cache is *appended* when its keys (and values) are ``Concat(past, new)`` along the
sequence axis and that Concat is also a model output (the present). A lowering that runs
the layer on a kernel with past and present returns the kernel's presents in a
:class:`Lowered`, and the stage-2 rule that matched the Concats returns them in their place
(a multi-output rule: nothing is patched after the rules ran).
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from mha_onnx.rewrite.forms import Form
from mha_onnx.rewrite.irutil import ints_attr, onehot_dim, replace_shape
from mha_onnx.rewrite.lower.rows import RowSource
from mha_onnx.rewrite.recognise.scores import heads_merged, heads_split


@dataclasses.dataclass(frozen=True)
class Appended:
    """x = Concat(past, new) along the sequence axis of [B, G, T, D]."""

    concat: ir.Value
    past: ir.Value
    new: ir.Value

    def rebuilt(self, ops, past: ir.Value | None = None) -> ir.Value:
        """The Concat made again where it is needed (in a branch), of ``past`` (default:
        the whole past) and the new positions, typed as the original."""
        made = ops.Concat(self.past if past is None else past, self.new, axis=2)
        made.shape, made.dtype = self.concat.shape, self.concat.dtype
        return made


Caches = tuple[Appended, Appended]  # (key, value)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """One Sdpa lowered: its fused [B, S, H*Dv] output and form; for a layer whose appended
    caches the rule matched (``caches``), the kernel's ``presents`` that replace their Concats
    (None: the form reads the Concats, which the rule makes again). ``shared``: the presents
    are max-length buffers, as the pasts become (lower/shared.py); ``rows``: the buffers are
    laid out by per-row lengths read from that padding input (lower/rows.py)."""

    out: ir.Value
    form: Form
    caches: Caches | None = None
    presents: tuple[ir.Value, ir.Value] | None = None
    shared: bool = False
    rows: RowSource | None = None

    @property
    def kernel(self) -> ir.Node | None:
        """The node that returns the presents (an If over the forms)."""
        return None if self.presents is None else self.presents[0].producer()


def undo_transposes(x: ir.Value) -> ir.Value:
    """``x`` = Transpose(Transpose(y)) whose perms cancel (K^T transposed back, as a K^T
    export such as GPT-2's reaches stage 2) -> y."""
    outer = x.producer()
    if outer is None or outer.op_type != "Transpose" or outer.domain not in ("", "ai.onnx"):
        return x
    inner = outer.inputs[0].producer() if outer.inputs[0] is not None else None
    if inner is None or inner.op_type != "Transpose" or inner.domain not in ("", "ai.onnx"):
        return x
    first, second = ints_attr(inner, "perm"), ints_attr(outer, "perm")
    if first is None or second is None or len(first) != len(second):
        return x
    return inner.inputs[0] if [first[i] for i in second] == list(range(len(first))) else x


def undo_head_merge(x: ir.Value) -> ir.Value:
    """``x`` = [B*H, T, D] -> [B, H, T, D] of y = [B, H, T, D] -> [B*H, T, D] (heads merged
    into the batch for a bmm, split back for the Sdpa: XGLM's caches) -> y."""
    outer = x.producer()
    inner = outer.inputs[0].producer() if outer is not None and outer.inputs \
        and outer.inputs[0] is not None else None
    if outer is None or inner is None or outer.domain not in ("", "ai.onnx") \
            or inner.domain not in ("", "ai.onnx"):
        return x
    heads = heads_split(outer)
    return inner.inputs[0] if heads and heads_merged(inner) == heads else x


def appended(x: ir.Value) -> Appended | None:
    """``x`` as Concat(past, new) on the sequence axis of a rank-4 tensor, else None."""
    node = x.producer()
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx") \
            or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return None
    axis = node.attributes["axis"].as_int()
    if x.shape is None or len(x.shape) != 4 or axis not in (2, -2):
        return None
    past, new = node.inputs
    return Appended(x, past, new)


def present_caches(key: ir.Value, value: ir.Value, reader: ir.Node) -> Caches | None:
    """The key and value caches a stage-2 rule may return the presents of: both appended,
    both model outputs (the presents), read by nothing but ``reader`` (the Sdpa)."""
    caches = appended(key), appended(value)
    if caches[0] is None or caches[1] is None or caches[0].concat is caches[1].concat:
        return None
    for cache in caches:
        if not cache.concat.is_graph_output() \
                or any(user is not reader for user, _ in cache.concat.uses()):
            return None
    return caches[0], caches[1]


def prepare_caches(graph: ir.Graph, sdpa: ir.Node) -> None:
    """Before stage 2, for one Sdpa node of ``graph``: its K and V read without a pair of
    Transposes that cancel, and every Shape of an appended cache that is a model output
    computed from the Concat's inputs (Shape(past) + Shape(new) on the sequence axis), so
    that a mask built from the keys' length does not read the present the kernel returns."""
    for index in (1, 2):
        source = undo_head_merge(undo_transposes(sdpa.inputs[index]))
        if source is not sdpa.inputs[index]:
            sdpa.replace_input_with(index, source)
        cache = appended(source)
        if cache is None or not cache.concat.is_graph_output():
            continue
        for user, _ in list(cache.concat.uses()):
            if user.op_type == "Shape" and user.graph is graph:
                replace_shape(graph, user, lambda tape, c=cache: tape.op("Add", [
                    tape.op("Shape", [c.past]),
                    tape.op("Mul", [tape.op("Shape", [c.new]), onehot_dim(tape, 2)])]))
