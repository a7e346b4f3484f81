"""``--logits last``: a decoder whose LM head computes one position per row, the one a
generation loop reads, instead of every position of the prompt.

The position is each row's last kept new token (the last of the run's ``sequence_length``
positions the ``attention_mask`` keeps; the last position where it keeps none, or where the
model has no mask): a left-padded or unpadded row's last position, a right-padded row's
last real token (ONNX Runtime GenAI's padding). The hidden states of that position are
gathered right before the LM head's MatMul, and everything between that MatMul and
``logits`` works on each position alone (a bias, a scale, a soft-cap, a cast), so the
result is the original's logits at that position, exactly. ``logits`` becomes
[batch, 1, vocab]: GenAI takes a model whose logits have dim 1 of 1 as one that already
returns the last position.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from mha_onnx.errors import ConfigError
from mha_onnx.rewrite.irutil import const_array

LOGITS, IDS, MASK = "logits", "input_ids", "attention_mask"
# per-position ops that may lie between the LM head's MatMul and the logits output
_PER_POSITION = {"Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Identity"}


def _lm_head(output: ir.Value) -> ir.Node:
    """The MatMul [B, S, D] x [D, V] whose result reaches ``output`` through per-position
    ops with constant other operands only."""
    value = output
    while True:
        node = value.producer()
        if node is None:
            raise ConfigError("--logits last: the logits are not computed by a MatMul with a "
                              "weight (the LM head)", hint="export without --logits last")
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") \
                and const_array(node.inputs[1]) is not None and node.inputs[1].shape is not None \
                and len(node.inputs[1].shape) == 2:
            return node
        data = [v for v in node.inputs if v is not None and const_array(v) is None]
        if node.op_type not in _PER_POSITION or len(data) != 1:
            raise ConfigError(f"--logits last: {node.op_type} node {node.name!r} lies between "
                              "the LM head and the logits and is not a per-position op",
                              hint="export without --logits last")
        value = data[0]


def last_position_logits(model: ir.Model) -> None:
    """Gather each row's last kept new position before the LM head (in place)."""
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    output = next((v for v in graph.outputs if v.name == LOGITS), None)
    if output is None or IDS not in inputs:
        raise ConfigError("--logits last needs a decoder with input_ids and a logits output")
    head = _lm_head(output)
    hidden = head.inputs[0]
    tape = ir.tape.Tape()
    ids, mask = inputs[IDS], inputs.get(MASK)
    new = tape.op("Shape", [ids], {"start": 1, "end": 2})  # [1]: the run's new tokens
    if mask is not None:
        kept = tape.op("Cast", [tape.op("Not", [tape.op("Equal", [
            tape.op("Slice", [mask, tape.op("Neg", [new]), _const(tape, [2 ** 62]),
                              _const(tape, [1])]),
            tape.op("CastLike", [_const(tape, 0), mask])])])], {"to": ir.DataType.FLOAT})
        index = tape.op("ArgMax", [kept], {"axis": 1, "keepdims": 1,
                                           "select_last_index": 1})  # [B, 1]
    else:
        batch = tape.op("Shape", [ids], {"start": 0, "end": 1})
        index = tape.op("Expand", [tape.op("Sub", [new, _const(tape, [1])]),
                                   tape.op("Concat", [batch, _const(tape, [1])], {"axis": 0})])
    width = tape.op("Shape", [hidden], {"start": 2, "end": 3})
    where = tape.op("Expand", [tape.op("Unsqueeze", [index, _const(tape, [2])]),
                               tape.op("Concat", [tape.op("Shape", [index]), width],
                                       {"axis": 0})])  # [B, 1, D]
    gathered = tape.op("GatherElements", [hidden, where], {"axis": 1})
    graph.insert_before(head, tape.nodes)  # (the graph's inputs are read anywhere)
    head.replace_input_with(0, gathered)
    gathered.name = f"{hidden.name}_last_position"
    dims = list(output.shape) if output.shape is not None else ["batch", "length", "vocab"]
    output.shape = ir.Shape([dims[0], 1, *dims[2:]])


def _const(tape, values) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.array(values, np.int64))})


def last_index(feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    """int64 [B]: the position :func:`last_position_logits` keeps in each row of a run."""
    new = feeds[IDS].shape[1]
    if MASK not in feeds:
        return np.full(feeds[IDS].shape[0], new - 1, np.int64)
    kept = np.asarray(feeds[MASK])[:, -new:] != 0
    last = new - 1 - np.argmax(kept[:, ::-1], axis=1)
    return np.where(kept.any(axis=1), last, new - 1).astype(np.int64)


def at_last(logits: np.ndarray, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    """[B, S, V] logits of every position -> [B, 1, V] at :func:`last_index`."""
    if logits.shape[1] == 1:
        return logits
    return np.take_along_axis(logits, last_index(feeds)[:, None, None], axis=1)


class LastPosition:
    """A reference (``infer(feeds)``) whose logits of every position are given at the one
    position a ``--logits last`` model computes."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(self.inner.infer(feeds))
        if LOGITS in out:
            out[LOGITS] = at_last(out[LOGITS], feeds)
        return out


def with_last_logits(original: onnx.ModelProto) -> onnx.ModelProto:
    """``original`` with :func:`last_position_logits` applied, recorded in its metadata and
    checked against it (its logits at each row's kept position, every other output equal)
    on ORT CPU over validate's default cases; a mismatch is a FusionError (exit 1)."""
    from mha_onnx.graph import metadata
    from mha_onnx.graph.files import to_ir

    model = to_ir(original)
    last_position_logits(model)
    proto = ir.to_proto(model)
    metadata.write(proto, {"logits": {"positions": "last"}})
    _check(original, proto)
    return proto


def _check(original: onnx.ModelProto, changed: onnx.ModelProto) -> None:
    from mha_onnx.errors import FusionError
    from mha_onnx.graph.inputs import case_for, input_specs, iter_feeds
    from mha_onnx.runtime.ort import OrtRunner

    specs = input_specs(original)
    cases = [case_for(specs, "one token", 1, [1], "none"),
             case_for(specs, "right padding and holes", 3, [7, 5], "some"),
             case_for(specs, "left padding", 4, [9, 3], "left"),
             case_for(specs, "a fully padded row", 2, [6, 4], "full")]
    with OrtRunner(original.SerializeToString()) as before, \
            OrtRunner(changed.SerializeToString()) as after:
        for case, feeds in iter_feeds(specs, cases):
            want, got = before.infer(feeds), after.infer(feeds)
            want[LOGITS] = at_last(want[LOGITS], feeds)
            for name, value in want.items():
                scale = 1e-4 if value.dtype == np.float32 else 2e-2
                if value.shape != got[name].shape or not np.allclose(
                        got[name], value, atol=scale, rtol=scale, equal_nan=True):
                    raise FusionError(f"--logits last: output {name!r} differs from the "
                                      f"original's at {case.describe()}",
                                      hint="please report this model; export without "
                                           "--logits last")
