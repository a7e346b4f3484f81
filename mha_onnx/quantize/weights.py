"""Weights in 4 or 8 bits: every MatMul with a constant weight onto ONNX Runtime's
``MatMulNBits``, by ONNX Runtime's own quantizer (``MatMulNBitsQuantizer``'s node quantizers:
RTN by its C++ kernels, or HQQ), in every graph of the model (the If branches of a fused
model too).

What this module adds to ORT's driver, which quantizes node by node: a weight read by
several MatMuls (a fused model's packed Q/K/V weight, read by the branches of an If) is
quantized once and its MatMulNBits nodes share the quantized initializers, which stay in
the graph the weight was in (ONNX Runtime prepacks a weight only from its MatMul's graph or
the one above); a weight a MatMul reads through a Slice of a constant (a packed weight read
in part by a fallback branch) is cut out first and quantized as its own; float weights
nothing reads any more are dropped; the fused forms, the interface and the metadata stay
as they were. Embeddings (Gather) keep their float weights.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from mha_onnx.errors import ConfigError
from mha_onnx.graph.walk import subgraphs
from mha_onnx.quantize import embeddings, w8a8
from mha_onnx.quantize.config import QuantizeConfig

log = logging.getLogger(__name__)

LAYER = re.compile(r"layers?[._/](\d+)[._/]")
# node metadata that names the module a node came from (torch.export's names do not)
SCOPES = ("namespace", "pkg.torch.onnx.name_scopes")


@dataclass(frozen=True)
class Target:
    """One MatMul with a constant weight: its node, the weight's name, the layer it sits in
    (from the names, where they say), and the bits it gets (0: kept float)."""

    node: str
    weight: str
    layer: int | None
    bits: int = 0
    graph: int = 0  # which graph holds it (_graphs' order): If branches repeat node names


def labelled(found) -> dict[str, int]:
    """MatMul -> bits for a report: the node's name, with ``@graph{n}`` where another graph
    has a node of that name (Optimum's merged decoders name both branches' nodes alike)."""
    found = list(found)
    twice = {n for n in (t.node for t in found) if sum(t.node == n for t in found) > 1}
    return {(f"{t.node}@graph{t.graph}" if t.node in twice else t.node): t.bits for t in found}


@dataclass(frozen=True)
class QuantizedWeights:
    model: onnx.ModelProto
    targets: tuple[Target, ...]
    float_bytes: int  # the weights quantized, as they were
    quantized_bytes: int  # and as they are (packed, scales, zero points)
    notes: tuple[str, ...] = field(default=())
    left: tuple[tuple[str, str], ...] = ()  # MatMuls of constant weights still float, why

    def matmuls(self) -> dict[str, int]:
        """MatMul -> bits (0: float), every MatMul of a constant weight counted: those
        planned and those whose weight is computed (float_left)."""
        planned = labelled(self.targets)
        return {**planned, **{name: 0 for name, _ in self.left if name not in planned}}

    def record(self, config: QuantizeConfig) -> dict[str, Any]:
        return {**config.to_dict(), "matmuls": self.matmuls(),
                "float_bytes": self.float_bytes, "quantized_bytes": self.quantized_bytes}


def _graphs(graph: onnx.GraphProto, stack: list | None = None
            ) -> Iterator[tuple[onnx.GraphProto, list[onnx.GraphProto]]]:
    """Every graph with the stack of graphs above it (itself last)."""
    stack = [*(stack or []), graph]
    yield graph, stack
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _graphs(sub, stack)


def _initializer(name: str, stack: list[onnx.GraphProto]):
    for graph in reversed(stack):
        for tensor in graph.initializer:
            if tensor.name == name:
                return tensor, graph
    return None, None


def _weight_2d(tensor: onnx.TensorProto) -> bool:
    dims = list(tensor.dims)
    return len(dims) >= 2 and all(d == 1 for d in dims[:-2]) \
        and tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def already_quantized(model: onnx.ModelProto) -> bool:
    return any(n.op_type in ("MatMulNBits", "GatherBlockQuantized", "DequantizeLinear",
                             "MatMulIntegerToFloat", "MatMulInteger")
               for graph, _ in _graphs(model.graph) for n in graph.node)


def _matmuls(model: onnx.ModelProto) -> list[tuple[Target, tuple[str, ...]]]:
    """The MatMuls with a constant 2-D weight (found in their graph or one above), each
    with the names a pattern is matched against: the node's, the weight's and the module
    it came from (torch.export names the first two ``node_MatMul_7``, ``val_82``)."""
    found = []
    for index, (graph, stack) in enumerate(_graphs(model.graph)):
        for node in graph.node:
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
                continue
            tensor, _ = _initializer(node.input[1], stack)
            if tensor is None or not _weight_2d(tensor):
                continue
            scope = "/".join(p.value for p in node.metadata_props if p.key in SCOPES)
            where = LAYER.search(f"{node.name}/{tensor.name}/") or LAYER.search(scope + "/")
            found.append((Target(node.name, tensor.name, int(where.group(1)) if where else None,
                                 graph=index), (node.name, tensor.name, scope)))
    return found


def unmatched(model: onnx.ModelProto, config: QuantizeConfig) -> list[str]:
    """The --exclude and --mixed patterns that name no MatMul of ``model``."""
    names = [n for _, given in _matmuls(model) for n in given]
    return [p for p in (*config.exclude, *config.int8)
            if not any(fnmatch.fnmatch(n, p) for n in names)]


def targets(model: onnx.ModelProto, config: QuantizeConfig) -> list[Target]:
    """The MatMuls with a constant 2-D weight (found in their graph or one above), with
    the bits each gets."""
    matmuls = _matmuls(model)
    found = [target for target, _ in matmuls]
    given = {(t.graph, t.node): names for t, names in matmuls}
    layers = [t.layer for t in found if t.layer is not None]
    edges = {min(layers), max(layers)} if layers else set()
    wanted = {}
    for target in found:
        key = (target.graph, target.node)
        names = given[key]
        if any(fnmatch.fnmatch(n, p) for p in config.exclude for n in names):
            wanted[key] = 0
        elif any(fnmatch.fnmatch(n, p) for p in config.int8 for n in names) \
                or (config.first_last and target.layer in edges):
            wanted[key] = 8
        else:
            wanted[key] = config.bits
    shared: dict[str, int] = {}  # a weight several MatMuls read: one precision, the widest
    for t in found:
        if wanted[t.graph, t.node]:
            shared[t.weight] = max(shared.get(t.weight, 0), wanted[t.graph, t.node])
    return [Target(t.node, t.weight, t.layer, wanted[t.graph, t.node] and shared[t.weight],
                   t.graph) for t in found]


def cut_slices(model: onnx.ModelProto) -> int:
    """A MatMul whose weight is a Slice of a constant with constant bounds (a fallback
    branch reading part of a packed weight) reads that part as an initializer of its own,
    put beside the constant. Returns how many."""
    made = 0
    for node, slicer, stack in _weights_made_by(model, "Slice"):
        parts = [_initializer(name, stack)[0] for name in slicer.input]
        if any(p is None for p in parts[:3]) or any(
                name and p is None for name, p in zip(slicer.input[3:], parts[3:],
                                                      strict=True)):
            continue
        arrays = [numpy_helper.to_array(p) for p in parts]
        data, starts, ends = arrays[:3]
        axes = arrays[3] if len(arrays) > 3 else np.arange(len(starts))
        steps = arrays[4] if len(arrays) > 4 else np.ones(len(starts), np.int64)
        index = [slice(None)] * data.ndim
        for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
            index[int(axis)] = slice(int(start), int(end), int(step))
        name = f"{node.input[1]}_cut"
        _, home = _initializer(slicer.input[0], stack)
        home.initializer.append(numpy_helper.from_array(
            np.ascontiguousarray(data[tuple(index)]), name))
        node.input[1] = name
        made += 1
    return made


def _weights_made_by(model: onnx.ModelProto, op_type: str):
    """(MatMul, the ``op_type`` node making its weight, its graph's stack) in every graph."""
    for graph, stack in _graphs(model.graph):
        producers = {o: n for n in graph.node for o in n.output}
        for node in graph.node:
            made_by = producers.get(node.input[1]) if node.op_type == "MatMul" else None
            if made_by is not None and made_by.op_type == op_type:
                yield node, made_by, stack


def untie_transposes(model: onnx.ModelProto) -> int:
    """A MatMul whose weight is ``Transpose(W)`` of a 2-D constant (a tied LM head over the
    embedding table) reads ``W.T`` as an initializer of its own, beside W (which the
    embedding's Gather keeps reading in float), so it is quantized like any other. Returns
    how many."""
    made = 0
    for node, turn, stack in _weights_made_by(model, "Transpose"):
        tensor, home = _initializer(turn.input[0], stack)
        perm = next((list(a.ints) for a in turn.attribute if a.name == "perm"), [1, 0])
        if tensor is None or len(tensor.dims) != 2 or perm != [1, 0] or not _weight_2d(tensor):
            continue
        name = f"{tensor.name}_transposed"
        if _initializer(name, stack)[0] is None:
            home.initializer.append(numpy_helper.from_array(
                np.ascontiguousarray(numpy_helper.to_array(tensor).T), name))
        node.input[1] = name
        made += 1
    return made


def float_left(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """Every MatMul of ``model`` (any graph) still float whose weight is a constant or made
    from constants alone: (name, why it stayed float). What a report's "float" count is."""
    out = []
    for graph, stack in _graphs(model.graph):
        producers = {o: n for n in graph.node for o in n.output}
        for node in graph.node:
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
                continue
            tensor, _ = _initializer(node.input[1], stack)
            if tensor is not None:
                out.append((node.name, "excluded" if _weight_2d(tensor) else
                            "its weight is not a 2-D float matrix"))
                continue
            ops = _constant_path(node.input[1], producers, stack)
            if ops:
                out.append((node.name, "its weight is computed from a constant through "
                            + " <- ".join(ops)))
    return out


def _constant_path(name: str, producers: dict, stack: list, depth: int = 0) -> list[str]:
    """The ops from ``name`` up to constants alone (their op types), or [] where an input
    of the model or an activation is among what it reads."""
    node = producers.get(name)
    if node is None or depth > 8 or node.op_type in ("If", "Loop", "Scan"):
        return []
    ops = [node.op_type]
    for source in node.input:
        if not source or _initializer(source, stack)[0] is not None:
            continue
        deeper = _constant_path(source, producers, stack, depth + 1)
        if not deeper:
            return []
        ops += [o for o in deeper if o not in ops]
    return ops


def _quantizer(bits: int, config: QuantizeConfig):
    """ONNX Runtime's node quantizer for ``bits``."""
    from onnxruntime.quantization import matmul_nbits_quantizer as ort_q

    if config.algorithm == "hqq":
        return ort_q.HQQWeightOnlyQuantizer(ort_q.HQQWeightOnlyQuantConfig(
            block_size=config.block_size, bits=bits))
    return ort_q.DefaultWeightOnlyQuantizer(ort_q.DefaultWeightOnlyQuantConfig(
        block_size=config.block_size, is_symmetric=config.symmetric,
        accuracy_level=config.accuracy_level or None, bits=bits))


def quantize_weights(model: onnx.ModelProto, config: QuantizeConfig) -> QuantizedWeights:
    """``model`` (a copy) with its MatMuls' weights quantized as ``config`` says."""
    if already_quantized(model):
        raise ConfigError("the model is already quantized (it has MatMulNBits, "
                          "GatherBlockQuantized or DequantizeLinear nodes)",
                          hint="quantize its float original")
    model = _compact(model)  # (a copy: no serialized bytes beside it)
    notes = _read_apart(model)
    plan = targets(model, config)
    if not any(t.bits for t in plan):
        raise ConfigError("the model has no MatMul with a constant weight to quantize"
                          + (" that --exclude leaves" if plan else ""),
                          hint="quantize a model whose projections are MatMuls")
    for pattern in unmatched(model, config):
        notes.append(f"{pattern!r} names no MatMul here (nor its weight or module): it "
                     "changed nothing")
    if config.first_last and all(t.layer is None for t in plan):
        notes.append("--mixed first-last: no MatMul's name or metadata says its layer, so "
                     "none was put in int8 (name them with --mixed PATTERN)")
    if config.weights == "w8a8":  # (w8a8.py: an onnx-ir pass)
        model, weights = w8a8.replaced(model, {(t.graph, t.node) for t in plan if t.bits})
        done = {(w, 8) for w in weights}
    else:
        done = _replace_matmuls(model, plan, config)
    if config.embeddings != "float":  # (embeddings.py: an onnx-ir pass)
        model, said = embeddings.quantize_embeddings(model, int(config.embeddings[3:]),
                                                     config.block_size)
        swap = any(n.op_type == "GatherBlockQuantized" for n in model.graph.node)
        notes = [n.replace("stays float for its Gather", "has its own for its Gather")
                 if swap else n for n in notes] + said
    before = _drop_unread(model)
    model = _compact(model)
    after = sum(len(t.raw_data) or t.ByteSize() for graph, _ in _graphs(model.graph)
                for t in graph.initializer if any(t.name.startswith(f"{w}_") for w, _ in done)
                or embeddings.SUFFIX in t.name)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.add(domain="com.microsoft", version=1)
    left = tuple(float_left(model))
    if left:
        said = [f"{name} ({why})" for name, why in left]
        notes.append(f"{len(left)} MatMul(s) with a constant weight left float: "
                     + "; ".join(said[:8]) + (f"; ... ({len(said) - 8} more)"
                                               if len(said) > 8 else ""))
    return QuantizedWeights(model, tuple(plan), before, after, tuple(notes), left)


def read_apart(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the float ``model`` with its weights named as quantize_weights names
    them: those read through a Slice or a Transpose of a constant cut out and untied."""
    copy = _compact(model)
    _read_apart(copy)
    return copy


def _read_apart(model: onnx.ModelProto) -> list[str]:
    """Weights read through a Slice or a Transpose of a constant given initializers of their
    own (cut_slices, untie_transposes); the notes that say so."""
    notes = []
    cut = cut_slices(model)
    if cut:
        notes.append(f"{cut} MatMul weight(s) read as a Slice of a packed weight cut out "
                     "and quantized as their own")
    untied = untie_transposes(model)
    if untied:
        notes.append(f"{untied} MatMul weight(s) read as a Transpose of a constant (a tied LM "
                     "head over the embedding table) quantized as their own; the embedding "
                     "stays float for its Gather")
    return notes


def _replace_matmuls(model: onnx.ModelProto, plan: list[Target], config: QuantizeConfig
                     ) -> dict[tuple[str, int], onnx.NodeProto]:
    """Every planned MatMul replaced by its MatMulNBits (a weight several read: quantized
    once, its initializers shared); (weight, bits) -> the MatMulNBits made for it."""
    bits_of = {(t.graph, t.node): t.bits for t in plan}
    quantizers = {bits: _quantizer(bits, config) for bits in {t.bits for t in plan} - {0}}
    done: dict[tuple[str, int], onnx.NodeProto] = {}
    for index, (graph, stack) in enumerate(_graphs(model.graph)):  # (lazily: a graph's If
        # nodes are copies after its nodes are replaced, and their branches are walked then)
        nodes = []
        for node in graph.node:
            bits = bits_of.get((index, node.name), 0) if node.op_type == "MatMul" else 0
            if not bits:
                nodes.append(node)
                continue
            key = (node.input[1], bits)
            if key in done:  # a shared weight: its quantized initializers once
                twin = onnx.NodeProto()
                twin.CopyFrom(done[key])
                twin.input[0], twin.output[0] = node.input[0], node.output[0]
                twin.name = f"{node.name}_Q{bits}"
                nodes.append(twin)
                continue
            made = quantizers[bits].quantize(node, list(stack))
            done[key] = next(n for n in made if n.op_type == "MatMulNBits")
            nodes.extend(made)
        del graph.node[:]
        graph.node.extend(nodes)
    return done


def _compact(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` copied into a message of its own, field by field (no serialized bytes
    beside it). After the float weights are dropped: a message keeps what it parsed until
    the whole of it goes, one more float model's worth through the measuring and writing
    that follow."""
    compact = onnx.ModelProto()
    compact.CopyFrom(model)
    return compact


def _drop_unread(model: onnx.ModelProto) -> int:
    """Initializers no node of any graph reads (the float weights quantized) removed;
    their bytes."""
    read = {name for graph, _ in _graphs(model.graph) for n in graph.node for name in n.input}
    read |= {o.name for o in model.graph.output}
    dropped = 0
    for graph, _ in _graphs(model.graph):
        kept = []
        for tensor in graph.initializer:
            if tensor.name in read:
                kept.append(tensor)
            else:
                dropped += len(tensor.raw_data) or tensor.ByteSize()
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return dropped
