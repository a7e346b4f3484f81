"""``--algorithm gptq``: int4 weights that make up for each other's rounding on the inputs a
model sees (Frantar et al., "GPTQ", 2022), written into the MatMulNBits that RTN laid out.

Per weight W [K, N] (a MatMul's B): H = X^T X over the calibration prompts' activations X
[rows, K] at that MatMul. The input dims are quantized one after another; each one's
rounding error, scaled by the inverse Hessian's Cholesky factor, is taken off the dims not
yet quantized, so the output X W moves as little as it can. Blocks of ``block_size`` input
dims share a scale (MatMulNBits' layout; symmetric, the grid ONNX Runtime's RTN uses: the
block's largest magnitude at code -8), the scale set from the weights as they are when the
block's first dim comes up. With H the identity this is RTN, code for code.

The activations: the float model (with the weights cut and untied as quantize_weights does)
is run on the calibration prompts with every If replaced by the branch those prompts take
(ORT gives no value inside a branch), each MatMul's input an output. A weight no MatMul on
that path reads keeps RTN's codes (said in the note).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

PERCENT_DAMP = 0.01  # of the mean of H's diagonal, added to it (GPTQ's default)
COLUMNS = 128  # input dims updated together (the "lazy batch")


def quantized(weight: np.ndarray, hessian: np.ndarray, block: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ of ``weight`` [K, N] under ``hessian`` [K, K]: (codes [N, K'] in 0..15, scales
    [N, K' // block]), K' = K padded to a multiple of ``block`` with zero weights (as
    MatMulNBits pads it: the padded inputs are zeros, so those dims are dead)."""
    given, n = weight.shape
    k = -(-given // block) * block
    w = np.zeros((n, k))
    w[:, :given] = weight.T  # [N, K']: a row per output
    h = np.zeros((k, k))
    h[:given, :given] = hessian
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h[np.diag_indices(k)] += PERCENT_DAMP * np.mean(np.diag(h))
    inverse = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: H^-1 = U^T U
    codes = np.zeros((n, k), np.uint8)
    scales = np.zeros((n, k // block), np.float64)
    for start in range(0, k, COLUMNS):
        end = min(start + COLUMNS, k)
        errors = np.zeros((n, end - start))
        for i in range(start, end):
            if i % block == 0:
                scales[:, i // block] = _scale(w[:, i:i + block])
            scale = scales[:, i // block]
            code = np.clip(np.rint(w[:, i] / scale) + 8, 0, 15)
            codes[:, i] = code
            error = (w[:, i] - (code - 8) * scale) / inverse[i, i]
            w[:, i + 1:end] -= np.outer(error, inverse[i, i + 1:end])
            errors[:, i - start] = error
        w[:, end:] -= errors @ inverse[start:end, end:]
    codes[:, given:] = 0  # (the padding's codes as ORT's quantizer writes them)
    return codes, scales


def _scale(block: np.ndarray) -> np.ndarray:
    """Each row's scale: its largest magnitude (with its sign) at code -8; 1 for zeros."""
    at = np.argmax(np.abs(block), axis=1)
    largest = block[np.arange(block.shape[0]), at]
    return np.where(largest == 0, 1.0, largest / -8)


def packed(codes: np.ndarray, block: int) -> np.ndarray:
    """Codes [N, K] as MatMulNBits' B [N, K // block, block // 2], two a byte, low first."""
    n, k = codes.shape
    pairs = codes.reshape(n, k // block, block // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def flattened(model: onnx.ModelProto, run: Callable[[onnx.ModelProto, list[str]], dict]
              ) -> ir.Model:
    """``model`` with every If (nested ones too) replaced by the branch ``run`` takes:
    ``run(model, names)`` gives those values of a run on the calibration inputs."""
    from onnx_ir.passes.common import NameFixPass

    flat = ir.from_proto(model)
    NameFixPass()(flat)  # (names unique within each graph and the ones above it)
    while True:
        ifs = [node for node in flat.graph if node.op_type == "If"]
        if not ifs:
            return flat
        asked = [node.inputs[0] for node in ifs]
        extra = [v for v in dict.fromkeys(asked) if v not in flat.graph.outputs]
        flat.graph.outputs.extend(extra)
        values = run(ir.to_proto(flat), [v.name for v in dict.fromkeys(asked)])
        for value in extra:
            flat.graph.outputs.remove(value)
        for node in ifs:
            _inline(flat.graph, node, bool(np.asarray(values[node.inputs[0].name]).all()))
        _unique(flat.graph)


def _unique(graph: ir.Graph) -> None:
    """Nodes and values named apart, in place: sibling branches (each layer's If) name
    theirs alike, and they now sit in one graph."""
    nodes: set[str] = set()
    values = set(graph.initializers) | {v.name for v in graph.inputs}
    for number, node in enumerate(graph):
        if node.name in nodes:
            node.name = f"{node.name}_inlined{number}"
        nodes.add(node.name)
        for index, value in enumerate(node.outputs):
            if value.name in values:
                value.name = f"{value.name}_inlined{number}_{index}"
            if value.name:
                values.add(value.name)


def _inline(graph: ir.Graph, node: ir.Node, then: bool) -> None:
    """``node`` (an If of ``graph``) replaced by its ``then`` or else branch: the branch's
    nodes and initializers (renamed where ``graph`` has the name) moved up."""
    branch = node.attributes["then_branch" if then else "else_branch"].as_graph()
    nodes, outputs = list(branch), list(branch.outputs)
    branch.outputs.clear()
    for inner in nodes:
        branch.remove(inner)
    for name, value in list(branch.initializers.items()):
        del branch.initializers[name]
        if name in graph.initializers:
            value.name = f"{name}_inlined{len(graph.initializers)}"
        graph.register_initializer(value)
    graph.insert_before(node, nodes)
    for old, new in zip(node.outputs, outputs, strict=True):
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        if old.name and new.producer() in nodes:  # (not an outer value passed through)
            name, old.name = old.name, None
            new.name = name
    graph.remove(node, safe=True)


def activations(flat: ir.Model, weights: Sequence[str]) -> dict[str, list[str]]:
    """Each of ``weights`` -> the names of the inputs of the MatMuls in ``flat`` that
    read it (made graph outputs, in place)."""
    wanted, found = set(weights), {}
    for node in flat.graph:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") \
                and node.inputs[1] is not None and node.inputs[1].name in wanted:
            value = node.inputs[0]
            if value not in flat.graph.outputs and value not in flat.graph.inputs:
                flat.graph.outputs.append(value)
            found.setdefault(node.inputs[1].name, []).append(value.name)
    return found


def hessians(base: onnx.ModelProto, weights: Sequence[str],
             batches: Sequence[dict[str, np.ndarray]], folder: Path | None = None
             ) -> dict[str, np.ndarray]:
    """Each of ``weights`` read on the calibration path -> X^T X over every row of every
    batch (float32; one array for the weights that read the same inputs: Q/K/V, gate and
    up), from ``base`` (float, weights named as the quantized model's). ``folder``: the
    arrays are files there, mapped (a 7B model's are ~20 GB: the kernel writes them out
    where memory runs short), else in memory. The runs' sessions read the model from a
    scratch file (its weights mapped, not copied from bytes)."""
    from mha_onnx.graph.copies import scratch_file
    from mha_onnx.runtime.ort import OrtRunner

    def run(model: onnx.ModelProto, names: list[str]) -> dict:
        with scratch_file(model) as path, OrtRunner(path, prepacking=False) as runner:
            out = runner.infer({k: v for k, v in batches[0].items() if k in runner.input_names})
        return {name: out[name] for name in names}

    flat = flattened(base, run)  # (the batches share one shape: the same branches)
    reads = {weight: tuple(names) for weight, names in activations(flat, weights).items()}
    sums: dict[tuple[str, ...], np.ndarray] = {}  # weights reading the same input share one
    with scratch_file(ir.to_proto(flat)) as path, OrtRunner(path, prepacking=False) as runner:
        for feeds in batches:
            out = runner.infer({k: v for k, v in feeds.items() if k in runner.input_names})
            for names in set(reads.values()):
                for name in names:
                    x = out[name].reshape(-1, out[name].shape[-1]).astype(np.float32)
                    if names not in sums:
                        sums[names] = _zeros(x.shape[-1], folder, len(sums))
                    sums[names] += x.T @ x
            del out
    return {weight: sums[names] for weight, names in reads.items()}


def _zeros(size: int, folder: Path | None, number: int) -> np.ndarray:
    """A float32 [size, size] of zeros: a file in ``folder``, mapped, or in memory."""
    if folder is None:
        return np.zeros((size, size), np.float32)
    return np.lib.format.open_memmap(folder / f"hessian{number}.npy", mode="w+",
                                     dtype=np.float32, shape=(size, size))


def rewrite(quant: onnx.ModelProto, base: onnx.ModelProto, sums: dict[str, np.ndarray],
            block: int) -> list[str]:
    """The 4-bit codes and scales (RTN's ``<weight>_Q4`` and ``<weight>_scales``, any
    graph) of each weight in ``sums`` (its X^T X) replaced by GPTQ's, in place, from its
    float values in ``base``; the weights done."""
    from onnx import numpy_helper

    from mha_onnx.graph.walk import all_graphs

    floats = {t.name: t for g in all_graphs(base.graph) for t in g.initializer}
    tensors = {t.name: t for g in all_graphs(quant.graph) for t in g.initializer}
    done = []
    for weight, hessian in sums.items():
        codes_name, scales_name = f"{weight}_Q4", f"{weight}_scales"
        if codes_name not in tensors or scales_name not in tensors:
            continue  # (not 4 bits in this model)
        w = numpy_helper.to_array(floats[weight])
        if w.ndim != 2:
            continue
        codes, scales = quantized(w, hessian, block)
        old = tensors[scales_name]
        tensors[codes_name].CopyFrom(numpy_helper.from_array(packed(codes, block), codes_name))
        old.CopyFrom(numpy_helper.from_array(
            scales.astype(numpy_helper.to_array(old).dtype).reshape(old.dims), scales_name))
        done.append(weight)
    return done
