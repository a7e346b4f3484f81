"""Masks computed from one input's values, judged by evaluating them as a whole.

Exporters spell "causal and not padded" in many ways that depend on the values of a
``[B, T]`` input: Hugging Face's mask builders traced by TorchScript index the flattened
``attention_mask`` with ``b * T + t`` (``Gather``), slice a cached 4-D mask per layer, or
combine both with ``And``/``Where`` before adding ``finfo.min``. Rather than one recogniser
per spelling, the block's mask terms are cut out of the graph with that input fed and run at
several sizes: with nothing padded, what they mask must not vary over batch entries and heads
(that part is then classified like any size-only piece: causal, its alignment and window, or
nothing); with random padding patterns, in either polarity of the input (True = padded, or
Hugging Face's 1 = keep), they must mask exactly that plus the padded keys of each row. A mask
that passes is causal (or not) + key padding from that input, for every size tried.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mha_onnx.graph.inputs import ShapeCase, padding_pattern
from mha_onnx.rewrite.irutil import dims
from mha_onnx.rewrite.recognise.masks import REMOVES_KEY, Padding, ScoreDims, Term
from mha_onnx.rewrite.recognise.slices import Refused, SliceRunner, assignments, resolve

PATTERNS_PER_SIZE = 2


@dataclass(frozen=True)
class ValueMask:
    """What the evaluation found: the size-dependent part (as the oracle classifies it), the
    key padding and the weakest score a masked key gets."""

    masked: tuple[np.ndarray, ...]  # bool [S, T] per size tried, nothing padded
    padding: Padding
    fill: float


def value_inputs(values: Sequence[ir.Value]) -> list[ir.Value]:
    """Graph inputs whose values (not only sizes) ``values`` depend on."""
    stack, seen, found = list(values), set(), {}
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        node = value.producer()
        if node is None:
            if value.const_value is None and not value.is_initializer():
                found[id(value)] = value
            continue
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx"):
            continue
        stack.extend(v for v in node.inputs if v is not None)
    return list(found.values())


def evaluate(model: ir.Model, symbols: list[str], lengths_for: Callable[[list[int]], list[int]],
             terms: Sequence[Term], sd: ScoreDims, floors: dict[str, int] | None = None
             ) -> ValueMask:
    """Evaluate ``terms`` (see the module docstring); raises Refused with the reason.
    ``lengths_for(constants)``: the lengths to try, given the integer constants of the piece
    (so that a window is evaluated past its size); ``floors``: the inputs' least sizes."""
    if any(t.lift for t in terms):
        raise Refused("a mask applied with batch and heads merged")
    sources = value_inputs([t.value for t in terms])
    if len(sources) != 1:
        raise Refused(f"the mask depends on the values of {len(sources)} inputs, not one [B, T]")
    source = sources[0]
    shape = dims(source)
    if shape is None or len(shape) != 2 or source.dtype is None:
        raise Refused("the mask's input is not a [B, T] tensor")
    runner = SliceRunner(model, [t.value for t in terms], set(symbols), fed=(source,))
    name = runner.inputs_by_id[id(source)]
    lengths = lengths_for(runner.constants())
    verdicts: dict[bool, ValueMask | str] = {}
    for inverted in (True, False):  # 1 = keep (Hugging Face's attention_mask) first
        try:
            verdicts[inverted] = _judge(runner, name, source, inverted, symbols, lengths, terms, sd,
                                        floors)
        except Refused as exc:
            verdicts[inverted] = str(exc)
    for verdict in verdicts.values():
        if isinstance(verdict, ValueMask):
            return verdict
    raise Refused(str(verdicts[True]))


def _judge(runner: SliceRunner, name: str, source: ir.Value, inverted: bool,
           symbols: list[str], lengths: list[int], terms: Sequence[Term], sd: ScoreDims,
           floors: dict[str, int] | None) -> ValueMask:
    rng = np.random.default_rng(0)
    dtype = source.dtype.numpy()  # type: ignore[union-attr]
    masked_per_size, fills = [], []
    for assignment in assignments(symbols, lengths, floors):
        b, s, t = (resolve(d, assignment) for d in (sd.batch, sd.seq_q, sd.seq_kv))
        want = [resolve(d, assignment) for d in dims(source) or []]
        if None in (b, s, t) or want != [b, t]:
            raise Refused("the mask's input is not [batch, keys] of the scores")
        nothing = np.zeros((b, t), dtype=bool)
        base, fill = _masked(terms, runner.run(assignment, {name: _feed(nothing, inverted, dtype)}),
                             (b, s, t))
        if not (base == base[:1, :1]).all():
            raise Refused("with nothing padded, the mask differs per batch entry or head")
        masked_per_size.append(base[0, 0])
        fills.append(fill)
        for _ in range(PATTERNS_PER_SIZE):
            padded = padding_pattern(b, t, ShapeCase("padding", {}, "full"), rng)
            got, fill = _masked(terms, runner.run(assignment, {name: _feed(padded, inverted,
                                                                           dtype)}), (b, s, t))
            expected = base[:1, :1] | padded[:, None, None, :]
            if not np.array_equal(got, np.broadcast_to(expected, got.shape)):
                raise Refused("the mask does not mask the keys its [B, T] input pads "
                              "(checked by evaluation)")
            fills.append(fill)
    return ValueMask(tuple(masked_per_size), Padding(source, inverted), max(fills))


def _feed(padded: np.ndarray, inverted: bool, dtype: np.dtype) -> np.ndarray:
    return (~padded if inverted else padded).astype(dtype)


def _masked(terms: Sequence[Term], arrays: list[np.ndarray], sizes: tuple[int, int, int]
            ) -> tuple[np.ndarray, float]:
    """Which keys the terms mask, as bool [B, H or 1, S, T], and the weakest masked score;
    additive terms must add nothing to the keys they keep (else they are biases)."""
    b, s, t = sizes
    masked, fill = None, -math.inf
    for term, array in zip(terms, arrays, strict=True):
        array = np.asarray(array)
        array = array.reshape((1,) * (4 - array.ndim) + array.shape) if array.ndim < 4 else array
        if array.ndim != 4 or array.shape[0] not in (1, b) or array.shape[2:] not in \
                ((1, 1), (1, t), (s, 1), (s, t)):
            raise Refused(f"a mask of shape {list(array.shape)} does not broadcast onto the "
                          f"scores [{b}, .., {s}, {t}]")
        array = np.broadcast_to(array, (b, array.shape[1], s, t))
        if term.mode == "replace":
            flag = array if array.dtype == np.bool_ else array != 0
            here = flag == term.masked_when
            if here.any():
                fill = max(fill, term.fill * term.post)
        else:
            scaled = array.astype(np.float64) * term.post
            here = scaled <= REMOVES_KEY
            if np.any(scaled[~here] != 0):
                raise Refused("the mask adds a bias that depends on input values")
            if here.any():
                fill = max(fill, float(scaled[here].max()))
        masked = here if masked is None else masked | here
    assert masked is not None
    return masked, fill
