"""The original model kept inside the one fuse (or a tuning) wrote, so that ``mha-onnx tune``
can re-tune a fused model on another machine without the original file.

What is kept is the original's graph without the weights the written model already holds:
a weight stored there under any name (the same bytes) is found again by its content, a
weight fuse packed into a joined tensor (``packed``: Q, K and V side by side) by its slice
of it; only what neither holds (a mask buffer, a weight fuse rewrote) is kept as bytes.
A weight is taken as held only where its bytes, dtype and shape match (by digest, or a
packed slice compared element by element), so a restore gives the original back exactly.
The record is one metadata value (``mha_onnx.graph.original``, base64 of the graph's protobuf,
compressed), which ``inspect`` shows by size.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from mha_onnx.graph import metadata
from mha_onnx.graph.files import all_initializers
from mha_onnx.graph.light import without_initializers

KEY = "original"
# Past this many bytes of weights the written model does not hold, the original is not kept
# (the record is a metadata string; re-tune such a model from its original file).
MAX_KEPT = 256 * 2 ** 20


def _digest(array: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array).tobytes()
                           + f"{array.dtype}{array.shape}".encode(), digest_size=16).hexdigest()


def record(original: onnx.ModelProto, model: onnx.ModelProto,
           packed: Mapping[str, list] | None = None, base: str = "") -> bool:
    """Keep ``original`` in ``model``'s metadata (see the module); ``packed``: name ->
    [joined, start, end] of the weights fuse packed (names as ``model`` has them; default:
    its "packed" metadata; ``base``: the folder ``model``'s external data lies in). False
    where it is not kept: the original's weights external, or too much that ``model`` does
    not hold."""
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in original.graph.initializer):
        return False
    packed = metadata.loaded(model, "packed") if packed is None else packed
    held = all_initializers(model.graph)
    by_content = {}
    for name, tensor in held.items():
        by_content.setdefault(_digest(numpy_helper.to_array(tensor, base)), name)
    kept = without_initializers(original)  # (not a copy of every weight)
    others = [(p.key, p.value) for p in kept.metadata_props
              if p.key not in (metadata.PREFIX + KEY, f"{metadata.PREFIX}{KEY}_weights")]
    del kept.metadata_props[:]
    for key, value in others:
        kept.metadata_props.add(key=key, value=value)
    found: list[list] = []  # [name, where or None (kept)] in the original's order
    size = 0
    for tensor in original.graph.initializer:
        array = numpy_helper.to_array(tensor)
        where = _where(tensor.name, array, held, by_content, packed or {}, base)
        found.append([tensor.name, where])
        if where is None:
            kept.graph.initializer.append(tensor)
            size += array.nbytes
    if size > MAX_KEPT:
        return False
    metadata.write(model, {KEY: base64.b64encode(zlib.compress(kept.SerializeToString())).decode(),
                           f"{KEY}_weights": found})
    return True


def _where(name: str, array: np.ndarray, held: dict, by_content: dict,
           packed: Mapping[str, list], base: str = "") -> list | None:
    """How ``model`` gives this weight back: [name] (a tensor of the same bytes) or
    [joined, start, end] (its slice of a packed one, checked equal); None: it does not."""
    same = by_content.get(_digest(array))
    if same is not None:
        return [same]
    if name in packed and packed[name][0] in held:
        joined, start, end = packed[name]
        piece = numpy_helper.to_array(held[joined], base)[..., int(start):int(end)]
        if piece.dtype == array.dtype and np.array_equal(piece, array):
            return [joined, int(start), int(end)]
    return None


def restore(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The original kept in ``model`` (None where none was)."""
    text = metadata.read(model).get(KEY)
    if text is None:
        return None
    try:
        original = onnx.ModelProto.FromString(zlib.decompress(base64.b64decode(text)))
        found = metadata.loaded(model, f"{KEY}_weights", list) or []
        held = all_initializers(model.graph)
        kept = {t.name: t for t in original.graph.initializer}
        del original.graph.initializer[:]
        for name, where in found:
            if where is None:
                original.graph.initializer.append(kept[name])
                continue
            array = numpy_helper.to_array(held[where[0]])
            if len(where) == 3:
                array = array[..., int(where[1]):int(where[2])]
            original.graph.initializer.append(numpy_helper.from_array(
                np.ascontiguousarray(array), name))
    except (ValueError, KeyError, IndexError, TypeError, zlib.error) as exc:
        raise metadata.damaged(KEY, exc) from exc
    return original
