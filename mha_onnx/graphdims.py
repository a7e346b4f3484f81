"""Sizes a graph takes where its inputs leave them symbolic.

An Optimum ViT names every dim of ``pixel_values`` (``[batch_size, num_channels, height,
width]``), yet its Conv weight fixes the channels and its position table the image size: fed
a 1x1x1x1 image, nothing runs. An image input (one that reaches a Conv's data input) gets its
channels from the Conv weight (``C = W.shape[1] * group``) and, where height and width are
symbolic, the smallest size among the kernel's multiples and the usual image sizes at which
ONNX Runtime runs the model (batch 1). None runs: a one-line error naming ``--inputs``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import onnx

from mha_onnx.errors import InputSpecError
from mha_onnx.input_roles import consumers

log = logging.getLogger(__name__)

PASS_THROUGH = {"Cast", "Identity", "Sub", "Div", "Mul", "Add"}  # normalising an image
COMMON_SIZES = (224, 384, 512)
MAX_TRIALS = 10


def _conv_weights(model: onnx.ModelProto) -> dict[str, tuple[int, int, int]]:
    """Graph input -> (channels, kernel height, kernel width) of the first Conv it reaches."""
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
                    group = next((a.i for a in node.attribute if a.name == "group"), 1)
                    if len(w) == 4:
                        out[value.name] = (int(w[1]) * group, int(w[2]), int(w[3]))
                        break
                elif node.op_type in PASS_THROUGH:
                    frontier.extend(node.output)
    return out


def pin_dims(model: onnx.ModelProto, specs: Sequence) -> list:
    """``specs`` with the channels and image sizes of image inputs made concrete (see the
    module docstring); other specs as they are."""
    convs = _conv_weights(model)
    pinned = list(specs)
    for n, spec in enumerate(specs):
        if spec.name not in convs or len(spec.dims) != 4:
            continue
        channels, kh, kw = convs[spec.name]
        dims = list(spec.dims)
        if not isinstance(dims[1], int):
            dims[1] = channels
        pinned[n] = replace(spec, dims=tuple(dims))
        if isinstance(dims[2], int) and isinstance(dims[3], int):
            continue
        size = _image_size(model, pinned, n, max(kh, kw))
        dims[2] = size if not isinstance(dims[2], int) else dims[2]
        dims[3] = size if not isinstance(dims[3], int) else dims[3]
        pinned[n] = replace(spec, dims=tuple(dims))
    return pinned


_SIZES: dict[tuple[str, str], int] = {}  # (graph digest, input) -> size: trials run once


def _image_size(model: onnx.ModelProto, specs: list, index: int, kernel: int) -> int:
    """The smallest square size, of the candidates, at which ORT runs the model (found once
    per graph: input_specs is called by every stage)."""
    key = (hashlib.sha1(model.graph.SerializeToString()).hexdigest(), specs[index].name)
    if key not in _SIZES:
        _SIZES[key] = _try_sizes(model, specs, index, kernel)
    return _SIZES[key]


def _try_sizes(model: onnx.ModelProto, specs: list, index: int, kernel: int) -> int:
    from mha_onnx.runtimes import OrtRunner

    candidates = sorted({kernel * 2**k for k in range(8)} | set(COMMON_SIZES))[:MAX_TRIALS]
    spec = specs[index]
    reasons = []
    with OrtRunner(model.SerializeToString(), "cpu", optimization="basic") as runner:
        for size in candidates:
            square = {spec.dims[2]: size, spec.dims[3]: size}
            try:
                runner.infer({s.name: _trial_array(s, square) for s in specs})
            except Exception as exc:  # noqa: BLE001 - a size the graph does not take
                reasons.append(f"{size}: {str(exc)[:120]}")
                continue
            log.info("input %s: images of %dx%d (the smallest size the model runs at)",
                     spec.name, size, size)
            return size
    raise InputSpecError(
        f"input {spec.name!r} {list(spec.dims)}: the model runs at none of the image sizes "
        f"{candidates} ({reasons[0] if reasons else '?'})",
        hint="pass real inputs with --inputs FILE.npz")


def _trial_array(spec, sizes: dict) -> np.ndarray:
    """An input for one trial run: other symbolic dims 1, integers 1 (a kept token of id
    1), booleans False (nothing padded), floats random."""
    shape = [d if isinstance(d, int) else sizes.get(d, 1) for d in spec.dims]
    if spec.dtype.kind in "iu":
        return np.ones(shape, dtype=spec.dtype)
    if spec.dtype == np.bool_:
        return np.zeros(shape, dtype=bool)
    return np.random.default_rng(0).standard_normal(shape).astype(spec.dtype)
