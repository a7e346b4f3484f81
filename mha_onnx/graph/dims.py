"""Sizes a graph takes where its inputs leave them symbolic.

An Optimum ViT names every dim of ``pixel_values`` (``[batch_size, num_channels, height,
width]``), yet its Conv weight fixes the channels and its position table the image size: fed
a 1x1x1x1 image, nothing runs. An image input (one that reaches a Conv's data input) gets its
channels from the Conv weight (``C = W.shape[1] * group``) and, where height or width is
symbolic (a declared size kept), the size of a position table, else the smallest among the
kernel's multiples and the usual image sizes at which ONNX Runtime runs the model (batch 1)
and its first attention sees at least ``MIN_TOKENS`` tokens (an OCR recogniser [N, 3, 48, W]
runs at W = 3, attention over one token: a sweep that says nothing), else the one with the
most. None runs: a one-line error naming ``--inputs``. The spec keeps the declared dims
(``InputSpec.declared``): a real input of any size they admit is accepted.

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

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import onnx

from mha_onnx.errors import InputSpecError
from mha_onnx.graph.roles import consumers
from mha_onnx.graph.walk import attr

log = logging.getLogger(__name__)

PASS_THROUGH = {"Cast", "Identity", "Sub", "Div", "Mul", "Add"}  # normalising an image
COMMON_SIZES = (224, 384, 512)
MAX_TRIALS = 10
MIN_TOKENS = 16  # the least tokens an image's first attention should see in a sweep
ATTENTION_OPS = {"Softmax": -1, "MultiHeadAttention": 1, "GroupQueryAttention": 1,
                 "Attention": -2}  # op -> the axis of its token count (Softmax: the keys)


def _conv_weights(model: onnx.ModelProto) -> dict[str, tuple[int, int, int, int, int]]:
    """Graph input -> (channels, kernel height, kernel width, output channels, stride) of the
    first Conv it reaches."""
    weights = {t.name: t for t in model.graph.initializer}
    uses_of = consumers(model.graph)
    out = {}
    for value in model.graph.input:
        frontier, seen = [value.name], set()
        while frontier and value.name not in out:
            name = frontier.pop()
            if name in seen:
                continue
            seen.add(name)
            for node, _ in uses_of.get(name, []):
                if node.op_type == "Conv" and node.input[0] == name and node.input[1] in weights:
                    w = weights[node.input[1]].dims
                    group, strides = attr(node, "group", 1), attr(node, "strides", [1])
                    if len(w) == 4:
                        out[value.name] = (int(w[1]) * group, int(w[2]), int(w[3]), int(w[0]),
                                           int(strides[0]))
                        break
                elif node.op_type in PASS_THROUGH:
                    frontier.extend(node.output)
    return out


def _cache_dims(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """Cache input -> (kv heads, head size) of the GroupQueryAttention or MultiHeadAttention
    node reading it as its past (GenAI's builder names the head size ``kv_cache_dim``): the
    query's width (its MatMul's weight, or MatMulNBits' N) over the heads."""
    weights = {t.name: t for t in model.graph.initializer}
    made_by = {out: node for node in model.graph.node for out in node.output}

    def width(name: str) -> int | None:
        node = made_by.get(name)
        while node is not None and node.op_type in ("Add", "Cast", "Identity"):
            node = made_by.get(node.input[0])
        if node is None:
            return None
        if node.op_type == "MatMul" and node.input[1] in weights:
            return int(weights[node.input[1]].dims[-1])
        return attr(node, "N") if node.op_type == "MatMulNBits" else None

    out = {}
    for node in model.graph.node:
        if node.op_type not in ("GroupQueryAttention", "MultiHeadAttention"):
            continue
        attrs = {a.name: a.i for a in node.attribute}
        heads = attrs.get("num_heads", 0)
        kv = attrs.get("kv_num_heads", heads)
        packed = len(node.input) < 2 or not node.input[1]
        total = width(node.input[0]) if node.input else None
        if not heads or total is None:
            continue
        size = total // (heads + 2 * kv) if packed and node.op_type != "MultiHeadAttention" \
            else total // heads
        past = (3, 4) if node.op_type == "GroupQueryAttention" else (6, 7)
        for i in past:
            if len(node.input) > i and node.input[i]:
                out[node.input[i]] = (kv, size)
    return out


def pin_dims(model: onnx.ModelProto, specs: Sequence) -> list:
    """``specs`` with the channels and image sizes of image inputs made concrete (see the
    module docstring), and the heads and head size of cache inputs where they are symbolic;
    other specs as they are."""
    convs = _conv_weights(model)
    caches = _cache_dims(model)
    pinned = list(specs)
    for n, spec in enumerate(specs):
        if spec.name in caches and len(spec.dims) == 4:
            dims = list(spec.dims)
            for axis, size in zip((1, 3), caches[spec.name], strict=True):
                dims[axis] = size if not isinstance(dims[axis], int) else dims[axis]
            pinned[n] = replace(spec, dims=tuple(dims))
            continue
        if spec.name not in convs or len(spec.dims) != 4:
            continue
        channels, kh, kw, width, stride = convs[spec.name]
        dims = list(spec.dims)
        if not isinstance(dims[1], int):
            dims[1] = channels
        pinned[n] = replace(spec, dims=tuple(dims), declared=spec.dims)
        if isinstance(dims[2], int) and isinstance(dims[3], int):
            continue
        size = _image_size(model, pinned, n, max(kh, kw), _table_sizes(model, width, stride))
        dims[2] = size if not isinstance(dims[2], int) else dims[2]
        dims[3] = size if not isinstance(dims[3], int) else dims[3]
        pinned[n] = replace(spec, dims=tuple(dims), declared=spec.dims)
    return pinned


_SIZES: dict[tuple[str, str], int] = {}  # (graph digest, input) -> size: trials run once


def _image_size(model: onnx.ModelProto, specs: list, index: int, kernel: int,
                tables: list[int]) -> int:
    """The size of a position table (``tables``) or else the smallest square size, of the
    candidates, at which ORT runs the model (found once per graph: input_specs is called by
    every stage)."""
    key = (hashlib.sha1(model.graph.SerializeToString()).hexdigest(), specs[index].name)
    if key not in _SIZES:
        _SIZES[key] = _try_sizes(model, specs, index, kernel, tables)
    return _SIZES[key]


def _table_sizes(model: onnx.ModelProto, width: int, stride: int) -> list[int]:
    """Image sizes whose patch grid (``size / stride`` squared, with or without a class
    token) is as long as a table of ``width`` columns that no MatMul or Gemm reads (a position
    table). SigLIP runs an image of one patch by broadcasting it over its 16-row table: the
    smallest size that runs is not one the model was made for, and shape inference, which
    takes the table's length, gives the fused graph 16 patches."""
    read_by_matmul = {x for n in model.graph.node if n.op_type in ("MatMul", "Gemm")
                      for x in n.input}
    sizes = []
    for table in model.graph.initializer:
        dims = list(table.dims)
        if (len(dims) not in (2, 3) or dims[-1] != width or table.name in read_by_matmul
                or table.data_type not in _FLOATS or any(d != 1 for d in dims[:-2])):
            continue
        for rows in (dims[-2], dims[-2] - 1):
            side = int(round(rows ** 0.5))
            if rows > 1 and side * side == rows and side * stride not in sizes:
                sizes.append(side * stride)
    return sizes


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _try_sizes(model: onnx.ModelProto, specs: list, index: int, kernel: int,
               tables: list[int]) -> int:
    """A position table's size where the model runs at it; else the smallest candidate at
    which the first attention sees MIN_TOKENS tokens; else the one where it sees the most."""
    from mha_onnx.runtime.ort import OrtRunner

    smallest = sorted({kernel * 2**k for k in range(8)} | set(COMMON_SIZES))[:MAX_TRIALS]
    candidates = tables + [s for s in smallest if s not in tables]
    spec = specs[index]
    reasons, seen = [], {}
    watched, axis = _attention_tokens(model)
    with OrtRunner(watched.SerializeToString(), "cpu", optimization="basic") as runner:
        for size in candidates:
            sizes = {d: size for d in spec.dims[2:] if not isinstance(d, int)}
            failed, tokens = _counted_trial(runner, specs, sizes, axis)
            if failed:
                reasons.append(f"{size}: {failed[:120]}")
                continue
            seen[size] = tokens
            if size in tables or tokens is None or tokens >= MIN_TOKENS:
                break
    if seen:
        size = max(seen, key=lambda s: (seen[s] or 0, -candidates.index(s))) \
            if all((t or 0) < MIN_TOKENS for t in seen.values()) else list(seen)[-1]
        log.info("input %s: images of %s (%s)", spec.name,
                 "x".join(str(d if isinstance(d, int) else size) for d in spec.dims[2:]),
                 "its position table's" if size in tables else
                 f"its first attention over {seen[size]} tokens" if seen[size] else
                 "the smallest size it runs at")
        return size
    raise InputSpecError(
        f"input {spec.name!r} {list(spec.dims)}: the model runs at none of the image sizes "
        f"{candidates} ({reasons[0] if reasons else '?'})",
        hint="pass real inputs with --inputs FILE.npz")


def _attention_tokens(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int | None]:
    """``model`` with the token-counting value of its first attention (ATTENTION_OPS; the
    main graph's) as an extra output, and the axis to read; ``model`` and None without one."""
    for node in model.graph.node:
        if node.op_type in ATTENTION_OPS:
            value = node.output[0] if node.op_type == "Softmax" else node.input[0]
            if value in {o.name for o in model.graph.output}:
                return model, None
            watched = onnx.ModelProto()
            watched.CopyFrom(model)
            watched.graph.output.append(onnx.helper.make_empty_tensor_value_info(value))
            return watched, ATTENTION_OPS[node.op_type]
    return model, None


def _trial(runner, specs: Sequence, sizes: dict) -> str:
    """One trial run at ``sizes`` (see _trial_array): '' when the graph ran, else why not."""
    return _counted_trial(runner, specs, sizes, None)[0]


def _counted_trial(runner, specs: Sequence, sizes: dict, axis: int | None
                   ) -> tuple[str, int | None]:
    """``_trial`` and the last output's length along ``axis`` (where one is given and ran)."""
    try:
        outputs = runner.infer({s.name: _trial_array(s, sizes) for s in specs})
    except Exception as exc:  # noqa: BLE001 - sizes the graph does not take
        return str(exc) or type(exc).__name__, None
    last = list(outputs.values())[-1] if axis is not None else None
    if last is None or last.ndim < (axis + 1 if axis >= 0 else -axis):
        return "", None
    return "", int(last.shape[axis])


def _external(model: onnx.ModelProto) -> bool:
    """Weights in external files: not in memory here, so no trial run."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def _size(dim: str, sizes: dict) -> int:
    """A symbolic dim's trial size: ``a + b`` summed, an unknown name 1."""
    return sum(sizes.get(term.strip(), 1) for term in dim.split("+"))


def _trial_array(spec, sizes: dict) -> np.ndarray:
    """An input for one trial run: other symbolic dims 1, integers 1 (a kept token of id
    1), booleans False (nothing padded), floats random."""
    shape = [d if isinstance(d, int) else _size(d, sizes) for d in spec.dims]
    if spec.dtype.kind in "iu":
        return np.ones(shape, dtype=spec.dtype)
    if spec.dtype == np.bool_:
        return np.zeros(shape, dtype=bool)
    return np.random.default_rng(0).standard_normal(shape).astype(spec.dtype)


_FLOORS: dict[str, dict[str, int]] = {}  # graph structure -> {dim: least size}
FLOOR_LIMIT = 4096  # wav2vec2-base needs 400 samples
# ops of graphs that cut their lengths into windows or blocks, which may need a least length:
# convolutions and pooling; Einsum (LongT5's transient-global attention sums blocks of
# global_block_size tokens and fails below one block)
WINDOWED = {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "Einsum"}


def floor_dims(model: onnx.ModelProto, specs: Sequence) -> list:
    """``specs`` with the floors of the length dims the graph does not run at size 1 (see
    the module docstring); as they are for graphs without convolutions, pooling or Einsums."""
    leading = {s.dims[0] for s in specs if s.dims}
    names = sorted({d for s in specs for d in s.dims[1:] if isinstance(d, str) and "+" not in d}
                   - leading)
    if not names or not any(n.op_type in WINDOWED for n in model.graph.node) \
            or _external(model):
        return list(specs)
    key = _structure(model)
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


def _structure(model: onnx.ModelProto) -> str:
    """A key of the graph's structure (inputs, ops, weight shapes), not of its weights."""
    digest = hashlib.sha1(model.graph.input.__repr__().encode())
    digest.update(" ".join(n.op_type for n in model.graph.node).encode())
    digest.update(repr([(t.name, list(t.dims)) for t in model.graph.initializer]).encode())
    return digest.hexdigest()


def _find_floors(model: onnx.ModelProto, specs: Sequence, names: list[str]) -> dict[str, int]:
    from mha_onnx.runtime.ort import OrtRunner

    with OrtRunner(model.SerializeToString(), "cpu", optimization="basic") as runner:
        def runs(sizes: dict) -> bool:
            return not _trial(runner, specs, sizes)

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
    key = hashlib.sha1(model.graph.SerializeToString()).hexdigest()
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
    from mha_onnx.runtime.ort import OrtRunner

    names = sorted({d for s in specs for d in s.dims if isinstance(d, str) and "+" not in d})
    rising = {name: 2 + n for n, name in enumerate(names)}  # distinct small sizes, both ways
    falling = {name: 2 + len(names) - n for n, name in enumerate(names)}
    if _external(model):
        return False  # no trial run: the dims as named
    with OrtRunner(model.SerializeToString(), "cpu", optimization="basic") as runner:
        try:
            runner.session  # noqa: B018 - a graph ORT cannot load is not about its dims
        except Exception:  # noqa: BLE001
            return False
        reasons = [failed[:160] for failed in (_trial(runner, specs, sizes)
                                               for sizes in (rising, falling)) if failed]
        if not reasons:
            return False  # it runs at distinct sizes: the dims are free
        # (ORT's GroupQueryAttention on the CPU takes a prompt after a cache at batch 1 only)
        failed = _trial(runner, related, rising) and _trial(
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
