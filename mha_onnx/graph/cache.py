"""A model's KV-cache interface, in one place: which inputs are pasts and which outputs
their presents; whether the cache is a shared max-length buffer (``fuse --kv-cache
shared``); and how such a model runs as production runs it: one buffer bound with IO
binding as both a layer's past and its present, written in place.

:class:`SharedCache` puts a shared-buffer model behind the appended interface (pasts of
``past_seq`` positions in, presents of ``past_seq + new`` out) that the references,
verification and decode chains speak, while it runs on its own buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import onnx

from mha_onnx.graph.inputs import InputSpec
from mha_onnx.graph.walk import attr

LENGTH_INPUT = "past_sequence_length"  # shared buffers: the cached positions (int64 scalar)
KV_SCALE = "{}_kv_scale"  # an int8 cache's scale per past (quantize --kv-bits 8), float32
MAX_LENGTH = "max_sequence_length"  # shared buffers: their length dim


def cache_pairs(model: onnx.ModelProto) -> dict[str, str]:
    """past input -> present output: as fuse recorded them; else by structure (an output
    that is a past input with new positions concatenated) and by name (our
    ``past_key``/``present_key`` and Optimum's ``past_key_values.0.key``/``present.0.key``)."""
    from mha_onnx.graph import metadata

    recorded = metadata.loaded(model, "kv_cache")
    if recorded is not None and isinstance(recorded.get("pairs"), dict):
        # in the inputs' order (the record's JSON sorts its keys: layer 10 before layer 2)
        order = {value.name: n for n, value in enumerate(model.graph.input)}
        return dict(sorted(recorded["pairs"].items(),
                           key=lambda pair: order.get(pair[0], len(order))))
    outputs = {o.name for o in model.graph.output}
    pairs = _appended_outputs(model)
    for value in model.graph.input:
        name = value.name
        for candidate in (name.replace("past_key_values", "present"), name.replace("past", "present")):
            if "past" in name and candidate in outputs:
                pairs[name] = candidate
                break
    return pairs


def _appended_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Outputs Concat(past, new) on the sequence axis of a [B, H, T, D] input."""
    rank4 = {i.name for i in model.graph.input if len(i.type.tensor_type.shape.dim) == 4}
    outputs = {o.name for o in model.graph.output}
    pairs = {}
    for node in model.graph.node:
        axis = attr(node, "axis")
        if node.op_type == "Concat" and len(node.input) == 2 and axis in (2, -2) \
                and node.input[0] in rank4 and node.output[0] in outputs:
            pairs[node.input[0]] = node.output[0]
    return pairs


def has_int8_cache(model: onnx.ModelProto) -> bool:
    """Is ``model``'s cache in int8 (``quantize --kv-bits 8``)? By its scales' names: nothing
    is read, so a file whose tensors lie outside it answers too."""
    names = {t.name for t in model.graph.initializer}
    return any(KV_SCALE.format(v.name) in names for v in model.graph.input)


def is_shared(model: onnx.ModelProto) -> bool:
    """A model whose caches are max-length buffers (``fuse --kv-cache shared``): as fuse
    recorded it, or by its ``past_sequence_length`` input."""
    from mha_onnx.graph import metadata

    recorded = metadata.loaded(model, "kv_cache") or {}
    return bool(cache_pairs(model)) and (recorded.get("form") == "shared" or takes_length(model))


def takes_length(model: onnx.ModelProto) -> bool:
    """Does a shared-buffer model take its cached length as the ``past_sequence_length``
    input? (Else it reads it from the shapes: the mask's length minus the new tokens, as
    ONNX Runtime GenAI feeds a shared buffer.)"""
    return any(i.name == LENGTH_INPUT for i in model.graph.input)


def shared_view(model: onnx.ModelProto) -> tuple[list[InputSpec], dict[str, str]]:
    """(input specs, cache pairs); for a shared-buffer model, its inputs as the appended
    interface has them: no length input, pasts of the original's length dim (``past_seq``,
    so that a mask over ``past_seq + seq_q`` keys stays consistent with them)."""
    from mha_onnx.graph import metadata
    from mha_onnx.graph.inputs import input_specs

    specs, pairs = input_specs(model), cache_pairs(model)
    if not is_shared(model):
        return specs, pairs
    recorded = metadata.loaded(model, "kv_cache") or {}
    past_dim = str(recorded.get("past_dim") or LENGTH_INPUT)
    out = []
    for spec in specs:
        if spec.name == LENGTH_INPUT:
            continue
        if spec.name in pairs:
            spec = replace(spec, dims=(*spec.dims[:2], past_dim, *spec.dims[3:]))
        out.append(spec)
    return out, pairs


def new_tokens(specs: Sequence[InputSpec], pairs: Mapping[str, str],
               feeds: Mapping[str, np.ndarray]) -> int:
    """How many positions a run adds: dim 1 of the first data or ids input (the query's
    ``seq_q``, a decoder's ``input_ids``), which is never a mask over all keys."""
    for spec in specs:
        if spec.name not in pairs and spec.name != LENGTH_INPUT and spec.role != "mask" \
                and len(spec.dims) >= 2:
            return int(feeds[spec.name].shape[1])
    raise ValueError("no input carries the new tokens")


def row_layout(model: onnx.ModelProto) -> dict | None:
    """A shared-buffer model whose buffer rows hold each row's kept keys first (per-row
    lengths, rewrite/lower/rows.py): {"input": the padding mask, "zero_is_padded": its polarity}."""
    from mha_onnx.graph import metadata

    recorded = metadata.loaded(model, "kv_cache") or {}
    rows = recorded.get("rows")
    return dict(rows) if isinstance(rows, dict) else None


def kept_keys(feeds: Mapping[str, np.ndarray], rows: Mapping[str, Any]) -> np.ndarray:
    """bool [B, T]: the keys the padding input keeps."""
    mask = np.asarray(feeds[rows["input"]])
    zero = mask == 0
    return ~zero if rows["zero_is_padded"] else zero


def kept_first(past: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """[B, G, P, D] with each row's kept positions first, then its padded ones (in order):
    how a buffer with per-row lengths holds a cache."""
    order = np.argsort(~keep, axis=1, kind="stable")  # [B, P]
    return np.take_along_axis(past, order[:, None, :, None], axis=2)


def logical_present(buffer: np.ndarray, past: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """A per-row buffer after a step, as the appended interface's present [B, G, T, D]:
    cached kept positions from the buffer, cached padded ones as the past had them (the
    appended graph passes the past through), new positions from where the step wrote them
    (after the row's kept ones, kept-first)."""
    cached = past.shape[2]
    out = np.empty((*buffer.shape[:2], keep.shape[1], *buffer.shape[3:]), buffer.dtype)
    for b in range(keep.shape[0]):
        old, new, row = keep[b, :cached], keep[b, cached:], out[b]
        row[:, :cached][:, old] = buffer[b][:, :old.sum()]
        row[:, :cached][:, ~old] = past[b][:, ~old]
        placed = np.argsort(~new, kind="stable")  # the new positions in written order
        row[:, cached + placed] = buffer[b][:, old.sum() + np.arange(new.size)]
    return out


def _packed(pasts: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray],
            rows: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """Appended pasts as a shared buffer starts from them: as they are, or (``rows``) each
    row's kept positions first."""
    if rows is None:
        return dict(pasts)
    cached = next(iter(pasts.values())).shape[2]
    keep = kept_keys(feeds, rows)[:, :cached]
    return {name: kept_first(past, keep) for name, past in pasts.items()}


def to_shared(feeds: Mapping[str, np.ndarray], specs: Sequence[InputSpec],
              pairs: Mapping[str, str], headroom: int = 3,
              rows: Mapping[str, Any] | None = None,
              length_input: bool = True) -> dict[str, np.ndarray]:
    """Appended-interface feeds (``specs``: :func:`appended_specs`) as a shared-buffer model
    takes them: each past in a buffer ``headroom`` positions longer than the run needs (NaN
    after the past; ``rows``: each row's kept positions first) and, where the model takes
    it (``length_input``), the cached length as ``past_sequence_length``."""
    pasts = {name: feeds[name] for name in pairs}
    past_len = next(iter(pasts.values())).shape[2]
    capacity = past_len + new_tokens(specs, pairs, feeds) + headroom
    out = {k: v for k, v in feeds.items() if k not in pasts}
    pasts = _packed(pasts, feeds, rows)
    if length_input:
        out[LENGTH_INPUT] = np.array(past_len, np.int64)
    out.update({name: _buffer(past, capacity) for name, past in pasts.items()})
    return out


def _buffer(past: np.ndarray, capacity: int) -> np.ndarray:
    """``past`` at the start of ``capacity`` positions, NaN after it: a kernel that read
    beyond the cached length would show in the results."""
    buffer = np.full((*past.shape[:2], capacity, *past.shape[3:]), np.nan, past.dtype)
    buffer[:, :, :past.shape[2]] = past
    return buffer


def shared_buffers(pasts: Mapping[str, np.ndarray], capacity: int, device: str = "cpu") -> dict:
    """An OrtValue of ``capacity`` positions on ``device`` for each past, holding it."""
    import onnxruntime as ort

    return {name: ort.OrtValue.ortvalue_from_numpy(_buffer(past, capacity), device, 0)
            for name, past in pasts.items()}


def device_of(provider: str) -> str:
    """Where an execution provider's buffers live for IO binding."""
    return "cpu" if provider == "cpu" else "cuda"


def bound_step(session: Any, feeds: Mapping[str, np.ndarray], buffers: Mapping[str, Any],
               pairs: Mapping[str, str], device: str = "cpu") -> tuple[Any, Callable[[], None]]:
    """(binding, run): every past bound to its buffer (an OrtValue) and its present to the
    same buffer, so that ORT writes the new positions in place; the other outputs are
    allocated by ORT on ``device``. Feeds the model does not take are left out."""
    import onnxruntime as ort

    binding = session.io_binding()
    names = {i.name for i in session.get_inputs()}  # (a cached length it reads from shapes)
    for name, array in feeds.items():
        if name not in names:
            continue
        if name in buffers:
            binding.bind_ortvalue_input(name, buffers[name])
        else:
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(
                np.ascontiguousarray(array), device, 0))
    presents = {present: past for past, present in pairs.items()}
    for output in session.get_outputs():
        if output.name in presents:
            binding.bind_ortvalue_output(output.name, buffers[presents[output.name]])
        else:
            binding.bind_output(output.name, device, 0)
    return binding, lambda: session.run_with_iobinding(binding)


class SharedCache:
    """A shared-buffer model behind the appended interface. A run whose pasts are the
    presents this object returned last continues on its own buffers, in place (a decode
    chain, as production runs it); any other run starts buffers of ``max_length`` (at least
    the run's total) positions from the given pasts."""

    def __init__(self, runner: Any, specs: Sequence[InputSpec], pairs: Mapping[str, str],
                 max_length: int = 0, headroom: int = 3,
                 rows: Mapping[str, Any] | None = None) -> None:
        self.runner, self.specs, self.pairs = runner, list(specs), dict(pairs)
        self.rows = rows  # per-row lengths: buffers hold each row's kept keys first
        self.max_length, self.headroom = max_length, headroom
        self.device = device_of(runner.provider)
        self.io_binding = True
        self._buffers: dict[str, Any] = {}
        self._returned: dict[str, np.ndarray] = {}

    @property
    def provider(self) -> str:
        return self.runner.provider

    def close(self) -> None:
        self.runner.close()

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        pasts = {name: feeds[name] for name in self.pairs}
        past_len = next(iter(pasts.values())).shape[2]
        total = past_len + new_tokens(self.specs, self.pairs, feeds)
        continuing = self._buffers and all(pasts[n] is self._returned.get(self.pairs[n])
                                           for n in pasts) \
            and next(iter(self._buffers.values())).shape()[2] >= total
        keep = kept_keys(feeds, self.rows) if self.rows is not None else None
        if not continuing:
            capacity = max(self.max_length, total + self.headroom)
            self._buffers = shared_buffers(_packed(pasts, feeds, self.rows), capacity,
                                           self.device)
        step = {k: v for k, v in feeds.items() if k not in pasts}
        step[LENGTH_INPUT] = np.array(past_len, np.int64)
        binding, run = bound_step(self.runner.session, {**step, **pasts}, self._buffers,
                                  self.pairs, self.device)
        try:
            run()
        except Exception as exc:
            if type(exc).__module__.startswith("onnxruntime"):
                from mha_onnx.errors import ModelFileError

                raise ModelFileError(f"onnxruntime failed to run the model: {exc}") from exc
            raise
        names = [o.name for o in self.runner.session.get_outputs()]
        values = dict(zip(names, binding.copy_outputs_to_cpu(), strict=True))
        presents = set(self.pairs.values())
        past_of = {present: past for past, present in self.pairs.items()}
        out = {name: values[name] if name not in presents
               else values[name][:, :, :total].copy() if keep is None
               else logical_present(values[name], pasts[past_of[name]], keep)
               for name in names}
        self._returned = {q: out[q] for q in self.pairs.values()}
        return out
