"""A model's structure apart from its weights, so that the work that reads only shapes and
names (fuse's shape inference, the files written with external data, the original kept in a
fused model) does not hold one more copy of every weight.

A protobuf message's ``CopyFrom`` copies every byte of every tensor, and a field cleared
afterwards does not give its memory back (the message's arena keeps it until the whole
message goes): the copies here are made field by field, the weights left out as they go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

BIG = 1 << 20  # bytes: a tensor's data this long or longer is a weight (not a shape's value)


def copy_except(source: Message, target: Message, skipped: Iterable[str]) -> None:
    """Every field of ``source`` set in ``target``, those named in ``skipped`` left out."""
    skipped = set(skipped)
    for field, value in source.ListFields():
        if field.name in skipped:
            continue
        if field.is_repeated:
            getattr(target, field.name).extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def is_weight(tensor: onnx.TensorProto, big: int = BIG) -> bool:
    """A tensor whose data (raw bytes, in the message) is ``big`` bytes or more."""
    return tensor.HasField("raw_data") and tensor.ByteSize() >= big


def without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose main graph has no initializers."""
    out = onnx.ModelProto()
    copy_except(model, out, ["graph"])
    copy_except(model.graph, out.graph, ["initializer"])
    return out


def model_bytes(model: onnx.ModelProto) -> int:
    """``model.ByteSize()``, without it: protobuf's upb computes a message's size by
    encoding it (a transient buffer of about twice the model); here one tensor at a time."""
    graph = onnx.GraphProto()
    copy_except(model.graph, graph, ["initializer"])
    sizes = [tensor.ByteSize() for tensor in model.graph.initializer]
    inside = graph.ByteSize() + sum(1 + _varint(n) + n for n in sizes)
    rest = onnx.ModelProto()
    copy_except(model, rest, ["graph"])
    return rest.ByteSize() + (1 + _varint(inside) + inside if model.HasField("graph") else 0)


def structure(model: onnx.ModelProto, big: int = BIG
              ) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """(a copy of ``model`` whose main-graph weights, :func:`is_weight`, keep their name,
    type and dims but no data; those weights of ``model`` by name, not copied). Whatever
    reads the copy's values (a shape's, a Constant's) reads them there."""
    out = without_initializers(model)
    weights = {}
    for tensor in model.graph.initializer:
        if is_weight(tensor, big):
            weights[tensor.name] = tensor
            _described(tensor, out.graph.initializer.add())
        else:
            out.graph.initializer.add().CopyFrom(tensor)
    return out, weights


def checkable(model: onnx.ModelProto, big: int = BIG) -> onnx.ModelProto:
    """A copy of ``model`` for onnx.checker, which copies the whole model twice to judge it:
    each main-graph weight's data checked here against its type and dims (ValueError where
    it is too short, as the checker says), then stood in for by one element, as is each
    tensor left in external data."""
    out = without_initializers(model)
    for tensor in model.graph.initializer:
        outside = onnx.external_data_helper.uses_external_data(tensor)
        if not outside and not is_weight(tensor, big):
            out.graph.initializer.add().CopyFrom(tensor)
            continue
        described = _described(tensor, onnx.TensorProto())
        needed = _bytes(tensor.data_type, int(np.prod(tensor.dims, dtype=np.int64)))
        length = needed if outside else _raw_length(tensor.ByteSize(), described.ByteSize())
        if length < needed:  # (external data: its file is ORT's to read)
            raise ValueError(f"TensorProto (tensor name: {tensor.name}) raw_data size ({length} "
                             f"bytes) is too small for the declared shape and type ({needed} "
                             "bytes required)")
        del described.dims[:]
        described.dims.append(1)
        described.raw_data = bytes(_bytes(tensor.data_type, 1))
        out.graph.initializer.append(described)
    return out


def _bytes(data_type: int, count: int) -> int:
    """Bytes of ``count`` elements (4-bit types two to a byte)."""
    bits = 4 if data_type in _NIBBLES else 8 * onnx.helper.tensor_dtype_to_np_dtype(
        data_type).itemsize
    return (count * bits + 7) // 8


_NIBBLES = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4,
            getattr(onnx.TensorProto, "FLOAT4E2M1", -1)}


def _raw_length(whole: int, rest: int) -> int:
    """The length of a tensor's raw_data from the message's size with and without it (the
    field: a one-byte tag, the length as a varint, the bytes)."""
    extra = whole - rest - 1
    length = extra - 1
    while length + _varint(length) > extra:
        length -= 1
    return length


def _varint(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def outside_main(model: onnx.ModelProto) -> bool:
    """Whether a tensor other than a main-graph initializer (a branch's, a Constant's) has
    its data in an external file: what copies tensor by tensor here reads the main graph's
    only."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    every = sum(map(uses_external_data, _get_all_tensors(model)))
    return every > sum(map(uses_external_data, model.graph.initializer))


def structure_key(model: onnx.ModelProto) -> str:
    """A digest of ``model`` apart from its weights' values (their names, types and dims in
    it): what a trial run's outcome depends on, read without serializing every weight."""
    import hashlib

    return hashlib.sha1(structure(model)[0].SerializeToString()).hexdigest()


def lend(model, weights: Mapping[str, onnx.TensorProto]) -> int:
    """The main-graph initializers of ``model`` (onnx_ir) named in ``weights`` given those
    tensors' values, read when a pass or the serializer asks (never written through: a
    renamed value does not rename the tensor it reads). How many."""
    import onnx_ir as ir

    lent = 0
    for name, value in model.graph.initializers.items():
        tensor = weights.get(name)
        if tensor is None:
            continue
        value.const_value = ir.LazyTensor(
            lambda tensor=tensor: ir.serde.TensorProtoTensor(tensor),
            dtype=ir.DataType(tensor.data_type), shape=ir.Shape(list(tensor.dims)), name=name)
        lent += 1
    return lent


def external_copy(model: onnx.ModelProto, data: BinaryIO, location: str,
                  big: int = 1024, base: Path | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose main-graph initializers of ``big`` bytes or more are
    written to ``data`` (at its current end, one after another) and read from ``location``
    there; the rest (subgraphs' tensors, Constants) as in ``model``. ``base``: the folder of
    the external data ``model``'s initializers already have, copied into ``data`` too."""
    out = without_initializers(model)
    for tensor in model.graph.initializer:
        outside = base is not None and onnx.external_data_helper.uses_external_data(tensor)
        if not outside and not is_weight(tensor, big):
            out.graph.initializer.add().CopyFrom(tensor)
            continue
        offset = data.tell()
        if outside:
            _, (path, start, length), _ = _inline_parts(tensor, base)
            _copy_bytes(path, start, length, data)
        else:
            length = data.write(tensor.raw_data)
        made = _described(tensor, out.graph.initializer.add())
        made.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", length)):
            made.external_data.add(key=key, value=str(value))
    return out


def data_bytes(model: onnx.ModelProto) -> int:
    """The bytes of the main graph's initializers, in the message or in external files."""
    total = 0
    for tensor in model.graph.initializer:
        if onnx.external_data_helper.uses_external_data(tensor):
            entries = {entry.key: entry.value for entry in tensor.external_data}
            total += int(entries.get("length", 0))
        else:
            total += tensor.ByteSize()
    return total


def _copy_bytes(path: Path, offset: int, length: int, handle: BinaryIO) -> None:
    with path.open("rb") as source:
        source.seek(offset)
        left = length
        while left:
            chunk = source.read(min(1 << 24, left))
            if not chunk:
                raise ValueError(f"{path} ends {left} bytes before a tensor's data")
            handle.write(chunk)
            left -= len(chunk)


def _described(tensor: onnx.TensorProto, out: onnx.TensorProto) -> onnx.TensorProto:
    copy_except(tensor, out, ["raw_data", "external_data", "data_location"])
    return out


def write_inline(model: onnx.ModelProto, base: Path, handle: BinaryIO) -> None:
    """``model`` serialized into ``handle`` with its main-graph initializers' external data
    (read from ``base``) inline, one tensor at a time: protobuf's fields may come in any
    order, so the model's other fields come first, then its graph's, then each tensor."""
    graph = onnx.GraphProto()
    copy_except(model.graph, graph, ["initializer"])
    tensors = [_inline_parts(tensor, base) for tensor in model.graph.initializer]
    graph_bytes = graph.SerializeToString()
    inside = len(graph_bytes) + sum(_field_size(size) for _, _, size in tensors)
    rest = onnx.ModelProto()
    copy_except(model, rest, ["graph"])
    handle.write(rest.SerializeToString())
    handle.write(_tag(onnx.ModelProto, "graph") + _varint_bytes(inside) + graph_bytes)
    initializer = _tag(onnx.GraphProto, "initializer")
    for head, data, size in tensors:
        handle.write(initializer + _varint_bytes(size) + head)
        if data is not None:
            path, offset, length = data
            handle.write(_tag(onnx.TensorProto, "raw_data") + _varint_bytes(length))
            _copy_bytes(path, offset, length, handle)


def _inline_parts(tensor: onnx.TensorProto, base: Path):
    """(the tensor's bytes but its external data, (file, offset, length) of that or None,
    the whole tensor's size inline)."""
    if not onnx.external_data_helper.uses_external_data(tensor):
        head = tensor.SerializeToString()
        return head, None, len(head)
    entries = {entry.key: entry.value for entry in tensor.external_data}
    path = base / entries["location"]
    offset = int(entries.get("offset", 0))
    length = int(entries["length"]) if "length" in entries else path.stat().st_size - offset
    head = _described(tensor, onnx.TensorProto()).SerializeToString()
    return head, (path, offset, length), len(head) + _field_size(length)


def _field_size(length: int) -> int:
    return 1 + _varint(length) + length


def _tag(message, field: str) -> bytes:
    return _varint_bytes(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)
