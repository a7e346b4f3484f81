"""``--embeddings int4|int8``: the token embedding table read by ONNX Runtime's
``GatherBlockQuantized`` instead of a float ``Gather`` (opt-in: the table is the model's
input, and every token reads its row through the rounding).

Which Gather: one whose table is a 2-D float constant and whose indices are the model's
``input_ids`` (through Cast, Reshape, Squeeze or Unsqueeze at most): the token embedding, not
a rotary or position table a Gather also reads. A tied LM head already reads its own copy of
the table (weights.untie_transposes), so the float table goes once nothing reads it.

The codes: per block of ``block_size`` values along the hidden axis, symmetric round to
nearest, scale ``max |x| / (2^(bits-1) - 1)``, stored as uint8 with ORT's default zero point
2^(bits-1) (4 bits: two codes a byte, the low-order first), the scales in the table's type.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from mha_onnx.graph.decoder import IDS
from mha_onnx.rewrite.irutil import replace_node

THROUGH = ("Cast", "Reshape", "Squeeze", "Unsqueeze")
SUFFIX = "_Qgather"


def quantize_table(table: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes, packed for 4 bits; scales [rows, columns / block]) of a [rows, columns]
    table."""
    rows, columns = table.shape
    blocks = table.astype(np.float32).reshape(rows, columns // block, block)
    top = (1 << (bits - 1)) - 1
    scales = np.maximum(np.abs(blocks).max(-1), np.float32(1e-30)) / np.float32(top)
    codes = np.clip(np.rint(blocks / scales[..., None]), -top, top) + (1 << (bits - 1))
    codes = codes.astype(np.uint8).reshape(rows, columns)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return np.ascontiguousarray(codes), scales.astype(table.dtype)


def dequantize_table(codes: np.ndarray, scales: np.ndarray, bits: int, block: int
                     ) -> np.ndarray:
    """The table a GatherBlockQuantized of :func:`quantize_table`'s codes reads back."""
    if bits == 4:
        codes = np.stack([codes & 15, codes >> 4], -1).reshape(codes.shape[0], -1)
    values = codes.astype(np.float32) - (1 << (bits - 1))
    rows, columns = values.shape
    out = values.reshape(rows, columns // block, block) * scales.astype(np.float32)[..., None]
    return out.reshape(rows, columns).astype(scales.dtype)


def _reads_ids(value: ir.Value | None) -> bool:
    while value is not None and not value.is_graph_input():
        producer = value.producer()
        if producer is None or producer.op_type not in THROUGH:
            return False
        value = producer.inputs[0]
    return value is not None and value.name == IDS


def quantize_embeddings(model: onnx.ModelProto, bits: int, block: int
                        ) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with its token embedding tables' Gathers onto GatherBlockQuantized; the
    notes (which tables, or why none)."""
    made = ir.from_proto(model)
    graph = made.graph
    notes: list[str] = []
    done: dict[int, list[ir.Value]] = {}  # id(table) -> its codes and scales
    for node in list(graph):
        table = node.inputs[0] if node.op_type == "Gather" and node.domain in ("", "ai.onnx") \
            else None
        if table is None or table.const_value is None or not _reads_ids(node.inputs[1]) \
                or len(table.shape or ()) != 2 or node.attributes.get_int("axis", 0) != 0:
            continue
        array = table.const_value.numpy()
        if array.dtype not in (np.float32, np.float16) or array.shape[1] % block:
            notes.append(f"the embedding {table.name} kept float ({array.dtype}, "
                         f"{array.shape[1]} columns: int{bits} takes float32/float16 tables "
                         f"whose width is a multiple of --block-size {block})")
            continue
        codes, scales = quantize_table(array, bits, block)
        inputs = done.setdefault(id(table), [])
        for name, values in ((table.name + SUFFIX, codes), (table.name + SUFFIX + "_scales",
                                                               scales))[len(inputs):]:
            inputs.append(ir.Value(name=name, const_value=ir.tensor(values, name=name)))
            graph.register_initializer(inputs[-1])
        gather = ir.node("GatherBlockQuantized", [inputs[0], node.inputs[1], inputs[1]],
                         {"gather_axis": 0, "quantize_axis": 1, "block_size": block,
                          "bits": bits}, domain="com.microsoft",
                         name=f"{node.name or node.outputs[0].name}_Q{bits}")
        graph.insert_before(node, gather)
        replace_node(graph, node, gather.outputs[0])
        notes.append(f"the embedding {table.name} in int{bits} (GatherBlockQuantized, block "
                     f"{block}): {codes.nbytes + scales.nbytes:,} bytes for its "
                     f"{array.nbytes:,}")
    if not notes:
        notes.append(f"--embeddings int{bits}: no Gather of a constant table reads input_ids "
                     "(nothing changed)")
    if done:  # (a tied head's Transpose of the float table: read by nothing now)
        common_passes.RemoveUnusedNodesPass()(made)
    made.opset_imports.setdefault("com.microsoft", 1)
    return ir.to_proto(made), notes
