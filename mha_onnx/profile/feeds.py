"""What one profiled run feeds a model, and how it binds them.

A model with a KV cache is timed as production runs it: a decode step after ``context``
cached positions, or a prompt after none. Its caches are appended (a present one position
longer than the past, allocated by ONNX Runtime each run) or one buffer per cache bound as
past and present and written in place: a ``fuse --kv-cache shared`` model (as its metadata
records), and a graph of the appended interface whose ``genai_config.json`` beside it says
``past_present_share_buffer`` (ORT GenAI's builder's graph: GenAI's generator binds it so,
and timed appended it would pay a copy of the whole cache each step that GenAI never pays).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mha_onnx.errors import InputSpecError


@dataclass(frozen=True)
class Target:
    """A model file as profile runs it: its graph (weights not loaded) and whether its
    caches are buffers shared in place (``genai``: because GenAI's config says so)."""

    proto: onnx.ModelProto
    shared: bool
    genai: bool = False


def target(model: str) -> Target:
    from mha_onnx.graph import metadata
    from mha_onnx.graph.cache import cache_pairs, is_shared
    from mha_onnx.graph.decoder import read_genai_json
    from mha_onnx.graph.files import read_model

    proto = read_model(model, load_external_data=False)
    if is_shared(proto):
        return Target(proto, shared=True)
    genai = bool(cache_pairs(proto)) and metadata.loaded(proto, "kv_cache") is None \
        and bool(read_genai_json(Path(model).resolve().parent).get("past_present_share_buffer"))
    return Target(proto, shared=genai, genai=genai)


def point_feeds(model: Target, batch: int, length: int, *, decode: bool = False,
                pad_fraction: float = 0.0, inputs: str | None = None) -> dict[str, np.ndarray]:
    """One point's feeds: given (``inputs``), a decode step after ``length`` cached
    positions, or ``length`` new tokens (a cached model: a prompt after none)."""
    from mha_onnx.graph.cache import cache_pairs
    from mha_onnx.graph.inputs import case_for, input_specs, load_inputs, make_inputs

    specs = input_specs(model.proto)
    if inputs:
        return load_inputs(inputs, specs)
    if decode:
        return decode_feeds(model.proto, batch, length, shared=model.shared)
    padding = "tail" if pad_fraction else "none"
    if cache_pairs(model.proto):  # a prompt: seq_len new tokens, nothing cached
        try:
            return decode_feeds(model.proto, batch, 0, new=length, padding=padding,
                                pad_fraction=pad_fraction, shared=model.shared)
        except InputSpecError:  # no cache length to set: the inputs as they are
            pass
    case = case_for(specs, "profile", batch, [length], padding, pad_fraction)
    return make_inputs(specs, case)


def decode_feeds(proto: onnx.ModelProto, batch: int, context: int, *, new: int = 1,
                 padding: str = "none", pad_fraction: float = 0.0,
                 shared: bool | None = None) -> dict[str, np.ndarray]:
    """``new`` tokens (one: a decode step) after ``context`` cached positions (every cache
    input's length dim; a shared buffer: as many positions longer as the run writes,
    ``context`` of them cached). ``context`` 0: a prompt. ``shared``: the caches as buffers
    (default: where fuse recorded them so); a graph of the appended interface gets them
    without a length input, as GenAI feeds it (the cached length read from the mask)."""
    from mha_onnx.graph.cache import is_shared, row_layout, shared_view, to_shared
    from mha_onnx.graph.inputs import ShapeCase, case_for, make_inputs

    specs, pairs = shared_view(proto)  # a shared buffer's as the appended interface has them
    recorded = is_shared(proto)
    past = {s.dims[2] for s in specs if s.name in pairs and isinstance(s.dims[2], str)}
    if not past:
        raise InputSpecError("--decode needs a model with a KV cache (past_* inputs whose "
                             "present_* outputs it returns)")
    dims = {**case_for(specs, "decode", batch, [new]).dims, **dict.fromkeys(past, context)}
    dims.update(dict.fromkeys(_total_dims(specs, past), context + new))
    feeds = make_inputs(specs, ShapeCase("decode", dims, padding, pad_fraction))
    if not (recorded if shared is None else shared):
        return feeds
    return to_shared(feeds, specs, pairs, headroom=0, rows=row_layout(proto),
                     length_input=recorded)


def _total_dims(specs: Sequence, past: set[str]) -> set[str]:
    """A mask's length named on its own (GenAI's builder: ``total_sequence_length``): it
    spans the cached positions and the new ones. Left free, it took the new tokens' length,
    and ORT's GroupQueryAttention, which reads the total from the mask, attended to none of
    the ``context`` cached positions, without an error."""
    from mha_onnx.graph.expressions import is_expression

    elsewhere = {d for s in specs if s.role != "mask" for d in s.dims if isinstance(d, str)}
    return {s.dims[-1] for s in specs if s.role == "mask" and len(s.dims) == 2
            and isinstance(s.dims[-1], str) and not is_expression(s.dims[-1])} - past - elsewhere


def cache_bytes(feeds: dict[str, np.ndarray], model: Target, new: int = 1) -> int:
    """Bytes of cache a run of ``new`` tokens (a decode step: one) reads, in the model's
    cache type (an int8 cache: a quarter of float32's): every past input; of a shared
    buffer, the cached positions (the length input, else the buffer less the new tokens:
    profile's buffers have no spare room)."""
    from mha_onnx.graph.cache import LENGTH_INPUT, cache_pairs

    pasts = [feeds[name] for name in cache_pairs(model.proto)]
    if LENGTH_INPUT in feeds:
        cached = int(feeds[LENGTH_INPUT])
    elif model.shared and pasts:
        cached = pasts[0].shape[2] - new
    else:
        return sum(p.nbytes for p in pasts)
    return sum(p.nbytes // max(1, p.shape[2]) * cached for p in pasts)


def bound_run(runner, feeds: dict[str, np.ndarray], model: Target) -> Callable[[], Any]:
    """One run: inputs on the device once (IO binding) or plain host feeds; a shared KV
    cache bound as past and present (every run writes the same next position in place)."""
    from mha_onnx.graph.cache import bound_step, cache_pairs, device_of
    from mha_onnx.runtime.ort import import_ort

    if model.shared and hasattr(runner.session, "io_binding"):  # ORT: in place
        pairs, device = cache_pairs(model.proto), device_of(runner.provider)
        ort = import_ort(for_gpu=device != "cpu")
        buffers = {n: ort.OrtValue.ortvalue_from_numpy(feeds[n], device, 0) for n in pairs}
        return bound_step(runner.session, feeds, buffers, pairs, device)[1]
    if not runner.io_binding:
        return lambda: runner.infer(feeds)
    ort = import_ort(for_gpu=True)
    binding = runner.session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    for name in runner.output_names:
        binding.bind_output(name, "cuda", 0)
    return lambda: runner.session.run_with_iobinding(binding)
