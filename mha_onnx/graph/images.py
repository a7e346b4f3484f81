"""Image inputs made concrete, and cache inputs' heads (``pin_dims``).

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

A cache input whose heads or head size are symbolic (GenAI's builder names the head size
``kv_cache_dim``) takes them from the GroupQueryAttention or MultiHeadAttention reading it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace

import onnx

from mha_onnx.errors import InputSpecError
from mha_onnx.graph.roles import consumers
from mha_onnx.graph.trials import counted_trial, trial_runner
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
    smallest = sorted({kernel * 2**k for k in range(8)} | set(COMMON_SIZES))[:MAX_TRIALS]
    candidates = tables + [s for s in smallest if s not in tables]
    spec = specs[index]
    reasons, seen = [], {}
    watched, axis = _attention_tokens(model)
    with trial_runner(watched) as runner:
        for size in candidates:
            sizes = {d: size for d in spec.dims[2:] if not isinstance(d, int)}
            failed, tokens = counted_trial(runner, specs, sizes, axis)
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
