"""Sizes a graph takes where its inputs leave them symbolic.

Image and cache inputs made concrete: images.py (``pin_dims``).

torch.export with ``Dim.DYNAMIC`` names one axis anew on every input (batch ``s33`` on
input_ids, ``s6`` on attention_mask; a KV export's mask length unrelated to past + new), and
inputs generated at independent sizes make the original fail. Where the graph does not run
at distinct sizes for such names but runs once they are related (one batch; ids and masks of
one length, a mask over past + new when there are pasts), they are related; where it runs
at neither, a one-line error names the dims and ``--shapes``/``--inputs``.

A speech encoder fed raw samples (wav2vec2, HuBERT) runs a stack of strided convolutions
over them: below its receptive field (20 samples for kernels 10, 3 and strides 5, 2) the
graph does not run. Where a graph with convolutions does not run with its lengths at 1, each
length's least size is found by trial (doubling, then bisecting) and kept as the dim's
floor; generated cases lift their lengths above it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import onnx

from mha_onnx.errors import InputSpecError
from mha_onnx.graph.light import structure_key
from mha_onnx.graph.trials import external, trial, trial_runner

log = logging.getLogger(__name__)


_FLOORS: dict[str, dict[str, int]] = {}  # graph structure -> {dim: least size}
FLOOR_LIMIT = 4096  # wav2vec2-base needs 400 samples
# ops of graphs that cut their lengths into windows or blocks, which may need a least length:
# convolutions and pooling; Einsum (LongT5's transient-global attention sums blocks of
# global_block_size tokens and fails below one block)
WINDOWED = {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "Einsum"}


def _floor_names(model: onnx.ModelProto, specs: Sequence) -> list[str]:
    """The length dims whose floors floor_dims looks for ([] where it looks for none)."""
    leading = {s.dims[0] for s in specs if s.dims}
    names = sorted({d for s in specs for d in s.dims[1:] if isinstance(d, str) and "+" not in d}
                   - leading)
    return names if any(n.op_type in WINDOWED for n in model.graph.node) else []


def floor_dims(model: onnx.ModelProto, specs: Sequence) -> list:
    """``specs`` with the floors of the length dims the graph does not run at size 1 (see
    the module docstring); as they are for graphs without convolutions, pooling or Einsums."""
    names = _floor_names(model, specs)
    if not names or external(model):
        return list(specs)
    key = structure_key(model)
    if key not in _FLOORS:
        _FLOORS[key] = _find_floors(model, specs, names)
    floors = _FLOORS[key]
    return [replace(s, floors=tuple((d, floors[d]) for d in dict.fromkeys(s.dims)
                                    if isinstance(d, str) and d in floors)) for s in specs]


def dim_floors(specs: Sequence) -> dict[str, int]:
    """Every symbolic dim's least size over the inputs (see floor_dims)."""
    floors: dict[str, int] = {}
    for spec in specs:
        for name, least in spec.floors:
            floors[name] = max(floors.get(name, 1), least)
    return floors


def lifted(size: int, least: int) -> int:
    """``size``, or past a dim's floor ``least`` by as much (distinct sizes stay distinct)."""
    return size if size >= least else size + least - 1


def _find_floors(model: onnx.ModelProto, specs: Sequence, names: list[str]) -> dict[str, int]:
    with trial_runner(model) as runner:
        def runs(sizes: dict) -> bool:
            return not trial(runner, specs, sizes)

        try:
            runner.session  # noqa: B018 - a graph ORT cannot load is not about its sizes
        except Exception:  # noqa: BLE001
            return {}
        if runs({}):  # every symbolic dim 1: no floor
            return {}
        size = 2
        while size <= FLOOR_LIMIT and not runs(dict.fromkeys(names, size)):
            size *= 2
        if size > FLOOR_LIMIT:
            return {}  # it fails for another reason than its lengths
        floors = {}
        for name in names:
            low, high = 1, size  # it runs at high, not (known or tried) at low
            if runs({**dict.fromkeys(names, size), name: low}):
                continue
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (low, mid) if runs({**dict.fromkeys(names, size), name: mid}) \
                    else (mid, high)
            floors[name] = high
    log.info("least sizes the graph runs at: %s", floors)
    return floors


_RELATED: dict[str, bool] = {}  # graph digest -> relate its dims (trials run once)


def relate_dims(model: onnx.ModelProto, specs: Sequence) -> list:
    """``specs`` with the dims the graph relates named alike where they are named apart
    (see the module docstring); else as they are."""
    related = _related(specs)
    if related == list(specs):
        return list(specs)
    key = structure_key(model)
    if key not in _RELATED:
        _RELATED[key] = _needs_relating(model, specs, related)
    return related if _RELATED[key] else list(specs)


def _related(specs: Sequence) -> list:
    """One batch name on every first axis; ids and masks [B, L] of the ids' length (a mask
    over past + new when 4-D pasts have a symbolic length, all pasts of one length)."""
    first = [s.dims[0] for s in specs if s.dims and isinstance(s.dims[0], str)]
    seq = next((s.dims[1] for s in specs if len(s.dims) == 2 and s.role == "ids"
                and isinstance(s.dims[1], str)), None)
    past = next((s.dims[2] for s in specs if len(s.dims) == 4 and s.role == "data"
                 and isinstance(s.dims[2], str)), None)
    out = []
    for spec in specs:
        dims = list(spec.dims)
        if dims and isinstance(dims[0], str):
            dims[0] = first[0]
        if seq and len(dims) == 2 and spec.role in ("ids", "mask") and isinstance(dims[1], str):
            dims[1] = f"{past} + {seq}" if spec.role == "mask" and past else seq
        if seq and past and len(dims) == 4 and spec.role == "data" and isinstance(dims[2], str):
            dims[2] = past  # a decoder's caches: one cached length
        out.append(replace(spec, dims=tuple(dims)))
    return out


def _needs_relating(model: onnx.ModelProto, specs: Sequence, related: list) -> bool:
    """Does the model fail at distinct sizes for its dims but run with them related?"""
    names = sorted({d for s in specs for d in s.dims if isinstance(d, str) and "+" not in d})
    rising = {name: 2 + n for n, name in enumerate(names)}  # distinct small sizes, both ways
    falling = {name: 2 + len(names) - n for n, name in enumerate(names)}
    if external(model):
        return False  # no trial run: the dims as named
    with trial_runner(model) as runner:
        try:
            runner.session  # noqa: B018 - a graph ORT cannot load is not about its dims
        except Exception:  # noqa: BLE001
            return False
        reasons = [failed[:160] for failed in (trial(runner, specs, sizes)
                                               for sizes in (rising, falling)) if failed]
        if not reasons:
            return False  # it runs at distinct sizes: the dims are free
        # (ORT's GroupQueryAttention on the CPU takes a prompt after a cache at batch 1 only)
        failed = trial(runner, related, rising) and trial(
            runner, related, {**rising, **dict.fromkeys(_batch_names(related), 1)})
        if not failed:
            log.info("dims named apart related (the graph runs only so): %s", names)
            return True
        reasons.append(failed[:160])
    raise InputSpecError(
        f"the model runs neither at distinct sizes for its dims {names} nor with them "
        f"related ({reasons[0]})",
        hint="give their sizes with --shapes, or real inputs with --inputs FILE.npz")


def _batch_names(specs: Sequence) -> set[str]:
    return {s.dims[0] for s in specs if s.dims and isinstance(s.dims[0], str)}


def with_related_dims(model: onnx.ModelProto, specs: Sequence) -> onnx.ModelProto:
    """``model`` (a copy) whose inputs' symbolic dims are named as ``specs`` name them, so
    that shape inference carries one name per axis through the graph."""
    by_name = {s.name: s for s in specs}
    out = None
    for n, value in enumerate(model.graph.input):
        spec = by_name.get(value.name)
        dims = value.type.tensor_type.shape.dim
        if spec is None or len(spec.dims) != len(dims):
            continue
        for k, (dim, want) in enumerate(zip(dims, spec.dims, strict=True)):
            if isinstance(want, str) and dim.dim_param and dim.dim_param != want:
                out = out or _copy(model)
                out.graph.input[n].type.tensor_type.shape.dim[k].dim_param = want
    return out or model


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy
