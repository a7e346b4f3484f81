"""``fuse --kv-cache shared``: a KV-cache layer onto GroupQueryAttention over a max-length
cache buffer that is both its past and its present, so that a decode step writes one
position in place instead of copying the cache into a new present (ONNX Runtime's
past/present buffer sharing; the caller binds one buffer to both with IO binding).

The model's interface changes, which is why it is opt-in: each ``past_*`` input becomes a
buffer ``[batch, kv_heads, max_sequence_length, head_size]`` whose first
``past_sequence_length`` positions hold the cache (a new int64 scalar input, the same for
every row); each ``present_*`` output is that buffer with the new keys and values written
after them. Run without IO binding the result is the same, at the cost of a copy.

At run time an ``If`` picks the form:

- one new token, or a prompt (no past), and no key padded: GroupQueryAttention on the
  buffer (``seqlens_k`` = past + new - 1 for every row, ``total_sequence_length``);
- otherwise (new tokens after a past with a batch, which ORT's GQA refuses, or padded
  keys): the cache's valid part and the new keys concatenated, the original mask as a dense
  bias, and the new keys written into the buffer: exact, not fast.

Every ``Shape`` of a past input then reads its logical length (``past_sequence_length``) on
the sequence axis, so that positions and masks computed from the cache's length stay right.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mha_onnx.errors import ConfigError
from mha_onnx.graph.cache import LENGTH_INPUT, MAX_LENGTH
from mha_onnx.rewrite.forms import NO_PAST, ONE_TOKEN, UNPADDED, either
from mha_onnx.rewrite.forms import SHARED as SHARED_RUN
from mha_onnx.rewrite.irutil import insert_first, onehot_dim, replace_shape
from mha_onnx.rewrite.lower.common import (
    TapeOps,
    dense_mha,
    general_kernel,
    int_const,
    kernel_extras,
    none_padded,
    scalar_shape,
)
from mha_onnx.rewrite.lower.gqa import gqa_with_past, if_forms
from mha_onnx.rewrite.lower.lowered import Appended, Lowered
from mha_onnx.rewrite.lower.rows import RowSource, lower_rows, row_source
from mha_onnx.rewrite.sdpa import SdpaInfo, seq_dim, to_bsd


def shareable(key: Appended, value: Appended) -> bool:
    """Both caches are inputs of the model (not of a subgraph) appended to by a Concat that
    is an output of the model."""
    return all(x.past.is_graph_input() and x.concat.is_graph_output()
               and x.past.graph is x.concat.graph for x in (key, value))


def length_input(graph: ir.Graph) -> ir.Value:
    """The model's ``past_sequence_length`` input (int64 scalar), made on first use."""
    for value in graph.inputs:
        if value.name == LENGTH_INPUT:
            if value.dtype != ir.DataType.INT64:
                raise ConfigError(f"the model already has an input {LENGTH_INPUT!r} that is "
                                  "not an int64 scalar", hint="rename it before --kv-cache shared")
            return value
    value = ir.Value(name=LENGTH_INPUT, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    graph.inputs.append(value)
    return value


def lower_shared(op, info: SdpaInfo, q3: ir.Value, key: Appended, value: Appended
                 ) -> Lowered:
    """The output, the presents (buffers) and the form: with per-row lengths (rows.py)
    where the key padding is read from a model input, else one length for every row."""
    past = length_input(key.past.graph)
    rows = row_source(info.padded)
    if rows is not None:
        outs, form = lower_rows(op, info, q3, key, value, past)
        return Lowered(outs[0], form, (key, value), (outs[1], outs[2]), shared=True,
                       rows=rows)
    past32 = op.Cast(past, to=ir.DataType.INT32)
    new32 = op.Cast(op.Reshape(seq_dim(op, q3, 1), scalar_shape(op)), to=ir.DataType.INT32)
    total = op.Add(past32, new32)
    one = int_const(op, 1, np.int32)
    fast = op.Or(op.Equal(new32, one), op.Equal(past32, int_const(op, 0, np.int32)))
    if info.padded is not None:
        fast = op.And(fast, none_padded(op, info))
    seqlens = op.Expand(op.Sub(total, one), seq_dim(op, q3, 0))

    def gqa(ops: TapeOps):
        k3, v3 = to_bsd(ops, key.new, info.kv_heads), to_bsd(ops, value.new, info.kv_heads)
        return gqa_with_past(ops, info, q3, k3, v3, key.past, value.past, seqlens, total)

    outs = if_forms(op, info, fast, gqa, lambda o: _general(o, info, q3, key, value, past),
                    "shared", outputs=3)
    guard = "no past or one new token" + (", no key padded" if info.padded is not None else "")
    cases = (SHARED_RUN, NO_PAST, ONE_TOKEN) + ((UNPADDED,) if info.padded is not None else ())
    extras = kernel_extras(info)
    form = either(guard, f"GroupQueryAttention on a shared cache buffer{extras}".replace(
        "buffer, ", "buffer (", 1) + (")" if extras else ""),
        f"{general_kernel(info)} over the cache's valid part", cases=cases, reach=info.window)
    return Lowered(outs[0], form, (key, value), (outs[1], outs[2]), shared=True)


def _general(ops: TapeOps, info: SdpaInfo, q3, key, value, past: ir.Value):
    """The exact form at any length: attention over past[:length] ++ new with the original
    mask, and the new keys and values written into the buffer after the past."""
    zero, axis = int_const(ops, [0]), int_const(ops, [2])
    length = ops.Reshape(past, int_const(ops, [1]))
    end = ops.Add(length, seq_dim(ops, q3, 1))
    big = int_const(ops, [np.iinfo(np.int64).max])
    logical, buffers = [], []
    for cache in (key, value):
        made = cache.rebuilt(ops, ops.Slice(cache.past, zero, length, axis))
        logical.append(made)
        buffers.append(ops.Concat(made, ops.Slice(cache.past, end, big, axis), axis=2))
    wide = dataclasses.replace(info, key=logical[0], value=logical[1])
    return dense_mha(ops, wide, q3, lazy=True), buffers[0], buffers[1]


def share_interface(graph: ir.Graph, layers: list[Lowered]) -> int:
    """The pasts and presents of every shared layer become buffers of
    ``max_sequence_length`` positions, and every other ``Shape`` of a past reads its logical
    length. Returns how many layers share; refuses a past read by anything but shapes."""
    shared = [layer for layer in layers if layer.shared]
    pasts: dict[int, ir.Value] = {}
    for layer in shared:
        assert layer.caches is not None and layer.presents is not None
        for cache, present in zip(layer.caches, layer.presents, strict=True):
            pasts[id(cache.past)] = cache.past
            dims = list(cache.past.shape) if cache.past.shape is not None else [None] * 4
            cache.past.shape = ir.Shape(dims[:2] + [MAX_LENGTH] + dims[3:])
            present.shape = cache.past.shape
    if not shared:
        return 0
    length = length_input(graph)
    for past in pasts.values():
        for user, _ in list(past.uses()):
            if user.op_type == "Shape" and user.graph is graph:
                _logical_shape(graph, user, length)
            elif user.graph is graph and _live(user):
                raise ConfigError(f"--kv-cache shared: {past.name!r} is read by {user.op_type} "
                                  f"node {user.name!r}, not only by attention",
                                  hint="use the default appended cache for this model")
    return len(shared)


def length_from_shapes(graph: ir.Graph, rows: RowSource, pasts: set[str]) -> bool:
    """ONNX Runtime GenAI's shared-buffer contract: no ``past_sequence_length`` input, the
    cached length read from the shapes as ``mask.shape[1] - ids.shape[1]`` (the padding mask
    spans the cached and the new positions; the new tokens' input is the first other [B, S,
    ...] input). Returns whether it did (a model without such an ids input keeps the input).
    """
    inputs = {value.name: value for value in graph.inputs}
    length, mask = inputs.get(LENGTH_INPUT), inputs.get(rows.input)
    ids = next((v for v in graph.inputs if v.name not in pasts | {LENGTH_INPUT, rows.input}
                and v.shape is not None and len(v.shape) >= 2), None)
    if length is None or mask is None or ids is None:
        return False
    tape = ir.tape.Tape()
    total = tape.op("Shape", [mask], {"start": 1, "end": 2})
    new = tape.op("Shape", [ids], {"start": 1, "end": 2})
    scalar = tape.op("Constant", [], {"value": ir.tensor(np.array([], np.int64))})
    derived = tape.op("Reshape", [tape.op("Sub", [total, new]), scalar])
    insert_first(graph, tape.nodes)
    ir.convenience.replace_all_uses_with(length, derived)
    graph.inputs.remove(length)
    derived.name = f"{LENGTH_INPUT}_from_shapes"
    return True


def shared_rows(layers: list[Lowered]) -> RowSource | None:
    """The padding input every shared layer's buffers are laid out by (per-row lengths), or
    None (one length for every row); refuses layers that disagree, which one interface
    cannot serve."""
    layouts = {layer.rows for layer in layers if layer.shared}
    if len(layouts) > 1:
        raise ConfigError("--kv-cache shared: the layers read their key padding from "
                          "different inputs, so their buffers cannot share one layout",
                          hint="use the default appended cache for this model")
    return next(iter(layouts), None)


def _live(node: ir.Node) -> bool:
    """Whether anything reads the node (a Shape the rewrite above replaced does not)."""
    return any(out.uses() or out.is_graph_output() for out in node.outputs)


def _logical_shape(graph: ir.Graph, shape_node: ir.Node, length: ir.Value) -> None:
    """Shape(past) -> its shape with the sequence axis replaced by ``past_sequence_length``."""
    past = shape_node.inputs[0]
    replace_shape(graph, shape_node, lambda tape: tape.op("Add", [
        tape.op("Mul", [tape.op("Shape", [past]), onehot_dim(tape, 2, 0)]),
        tape.op("Mul", [length, onehot_dim(tape, 2)])]))
