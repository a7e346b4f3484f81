"""Which weights cost the most accuracy: each quantized weight alone, the logits' mean KL
against the float model's.

A weight "alone" is the float model with that one weight replaced by the values its
MatMulNBits reads back, (code - zero point) * scale (``dequantize``; w8a8's codes times
their column's scale), everything else
float. The float model is made once with every such weight also a graph input that
overrides its initializer (ONNX Runtime's overridable initializers): one session, and one
run per weight. A model copied, quantized and loaded per weight had run 16 minutes without
finishing the 81 weights of a 16-layer Llama of hidden 1024 (this: two minutes), and grows
with weights x model size.

What it measures is the weights' rounding: the float model computes in float, so
MatMulNBits' int8 activations (accuracy level 4) are not part of a weight's figure (they
are part of the whole model's figures beside it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from mha_onnx.graph.walk import all_graphs, all_nodes, attr
from mha_onnx.quantize import w8a8 as row_int8


def _codes(packed: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """Codes packed low-first in bytes, ``rows`` rows of them (uint8 -> int32)."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    codes = (packed.reshape(rows, -1)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(rows, -1).astype(np.int32)


def dequantize(node: onnx.NodeProto, value: Callable[[str], np.ndarray]) -> np.ndarray:
    """The [K, N] weight a MatMulNBits ``node`` multiplies by: B's codes (N rows of blocks,
    packed low-first) less their block's zero point (packed like the codes in bytes per row,
    or in the scales' type, or 2^(bits-1) when absent), times their block's scale; in the
    scales' type. ``value``: an input's array by name."""
    k, n, block = (int(attr(node, name)) for name in ("K", "N", "block_size"))
    bits = int(attr(node, "bits", 4))
    scales = value(node.input[2])
    blocks = -(-k // block)
    scale = scales.reshape(n, blocks).astype(np.float32)
    codes = _codes(value(node.input[1]), bits, n).reshape(n, blocks, block)
    zero: np.ndarray | float = float(1 << (bits - 1))
    if len(node.input) > 3 and node.input[3]:
        points = value(node.input[3])
        zero = (_codes(points, bits, n)[:, :blocks] if points.dtype == np.uint8
                else points.reshape(n, blocks)).astype(np.float32)[..., None]
    weight = (codes - zero) * scale[..., None]
    return np.ascontiguousarray(weight.reshape(n, blocks * block)[:, :k].T.astype(scales.dtype))


def read_back(quant: onnx.ModelProto, weights: Sequence[str]) -> dict[str, np.ndarray]:
    """Each of ``weights`` (float weight names) as the quantized model's MatMulNBits read
    it (ONNX Runtime's quantizer names its codes ``<weight>_Q<bits>``), where found."""
    tensors = {}
    for graph in all_graphs(quant.graph):
        tensors.update({t.name: t for t in graph.initializer})
    wanted = set(weights)
    found: dict[str, np.ndarray] = {}
    for node in all_nodes(quant.graph):
        if node.op_type not in ("MatMulNBits", "MatMulIntegerToFloat"):
            continue
        name = node.input[1].rsplit("_Q", 1)[0]
        if name in wanted and name not in found:
            found[name] = dequantize(node, lambda x: numpy_helper.to_array(tensors[x])) \
                if node.op_type == "MatMulNBits" else row_int8.dequantize(
                    *(numpy_helper.to_array(tensors[node.input[i]]) for i in (1, 3)))
    return found


def overridable(model: ir.Model, weights: Sequence[str]) -> list[str]:
    """Each of ``weights`` that is an initializer of ``model``'s main graph made a graph
    input too (fed, it is used instead of the initializer), in place; those names."""
    graph = model.graph
    made = []
    for name in dict.fromkeys(weights):
        value = graph.initializers.get(name)
        if value is None or value in graph.inputs:
            continue
        graph.inputs.append(value)
        made.append(name)
    return made
