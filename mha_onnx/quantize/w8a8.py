"""``--weights w8a8``: each MatMul's weight in int8 per output column, its activations
quantized to int8 per row at run time, multiplied by ONNX Runtime's integer GEMM
(``MatMulIntegerToFloat``: MLAS's u8s8 kernels, VNNI or AMX where the CPU has them).

Why a second form beside MatMulNBits: MatMulNBits (int4 or int8 weights, int8 activations
at accuracy level 4) computes a many-row product about row by row, while MLAS's integer GEMM
reads each weight once for all rows. Measured on an AMD EPYC with AVX-512 VNNI, 2 threads,
one [1024, 5632] weight (``python -m tools.bench_matmul``): 16 rows 0.40 ms against
MatMulNBits int4's 0.75 ms, 256 rows 5.2 against 11.4 ms; one row 0.13 against 0.10, and the
int8 weights are twice the int4 bytes a batch-1 step streams. So: the form for many rows at
once (a server's batched decode steps, long prompts); int4 for one user at a time
(docs/guide/quantize.md, docs/serve-bench-w8a8.md).

Each row's activations take their scale from that row alone (``max |x| / 127``, codes
``round(x / scale) + 128`` in uint8, zero point 128): a row's product never depends on the
other rows of its batch, so a served request's tokens are the same request's alone. (ONNX
Runtime's DynamicQuantizeLinear takes one scale for the whole tensor: one user's large
activations would coarsen another's.) The nodes per activation: Abs, ReduceMax, Max (a row
of zeros: a tiny scale, codes 128), Mul, Div, Round, Add, Cast, shared by every MatMul of
its graph that reads it; per MatMul: MatMulIntegerToFloat (A's scale 1, B's per column) and
a Mul by the rows' scales. A weight several MatMuls read (a fused model's If branches) is
quantized once, its codes beside it in the graph that holds it.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from mha_onnx.errors import ConfigError
from mha_onnx.graph.walk import all_graphs
from mha_onnx.rewrite.irutil import all_graphs as ir_graphs
from mha_onnx.rewrite.irutil import replace_node

PREFIX = "w8a8_"
SUFFIX = "_Q8rows"  # the int8 codes' name: <weight>_Q8rows (sensitivity.read_back finds them)
FLOAT = ir.TensorType(ir.DataType.FLOAT)


def replaced(model: onnx.ModelProto, planned: set[tuple[int, str]]
             ) -> tuple[onnx.ModelProto, set[str]]:
    """``model`` with the MatMuls ``planned`` names ((graph index in the order
    ``weights._graphs`` walks them, node name)) in this form; the weights quantized."""
    made = ir.from_proto(model)
    rows = RowInt8(planned)
    rows(made)
    out = ir.to_proto(made)
    for graph in all_graphs(out.graph):  # (onnx-ir writes the new values' partial types)
        kept = [v for v in graph.value_info if v.type.tensor_type.HasField("shape")
                or not v.type.HasField("tensor_type")]
        del graph.value_info[:]
        graph.value_info.extend(kept)
    return out, rows.quantized


class RowInt8(ir.passes.InPlacePass):
    """The planned MatMuls replaced (module doc); ``quantized``: the weights' names."""

    def __init__(self, planned: set[tuple[int, str]]) -> None:
        super().__init__()
        self.planned = planned
        self.quantized: set[str] = set()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.opset = model.opset_imports.get("", 17)
        self.constants = self._constants(model.graph)
        codes: dict[int, tuple[ir.Value, ir.Value]] = {}  # id(weight) -> codes, scales
        for index, graph in enumerate(list(ir_graphs(model.graph))):  # (weights._graphs'
            # order: a graph, then each node's subgraphs, depth first)
            rows: dict[int, tuple[ir.Value, ir.Value]] = {}  # id(activation) -> codes, scales
            for node in list(graph):
                if node.op_type == "MatMul" and (index, node.name) in self.planned:
                    self._replace(graph, node, codes, rows)
        model.opset_imports.setdefault("com.microsoft", 1)
        return ir.passes.PassResult(model, modified=bool(self.quantized))

    def _constants(self, graph: ir.Graph) -> dict[str, ir.Value]:
        f32 = np.float32
        values = {"eps": f32(1e-30), "inv127": f32(1 / 127), "f128": f32(128), "one": f32(1),
                  "zero_point": np.uint8(128)}
        if self.opset >= 18:
            values["axes"] = np.array([-1], np.int64)
        out = {}
        for key, value in values.items():
            name = PREFIX + key
            out[key] = ir.Value(name=name, const_value=ir.tensor(np.array(value), name=name))
            graph.register_initializer(out[key])
        return out

    def _replace(self, graph: ir.Graph, node: ir.Node, codes: dict, rows: dict) -> None:
        x, weight = node.inputs[0], node.inputs[1]
        if id(weight) not in codes:
            codes[id(weight)] = self._weight(weight, graph)
        w_codes, w_scales = codes[id(weight)]
        made: list[ir.Node] = []
        if id(x) not in rows:
            made, rows[id(x)] = self._rows(x)
        x_codes, x_scales = rows[id(x)]
        c = self.constants
        label = node.name or node.outputs[0].name  # (ORT refuses two nodes of one name)
        product = ir.node("MatMulIntegerToFloat",
                          [x_codes, w_codes, c["one"], w_scales, c["zero_point"]],
                          domain="com.microsoft", name=f"{label}_Q8",
                          outputs=[ir.Value(name=f"{node.outputs[0].name}{PREFIX}product",
                                            type=FLOAT)])
        scaled = ir.node("Mul", [product.outputs[0], x_scales], name=f"{label}_Q8_rows",
                         outputs=[ir.Value(name=f"{node.outputs[0].name}{PREFIX}rows",
                                           type=FLOAT)])
        graph.insert_before(node, [*made, product, scaled])
        replace_node(graph, node, scaled.outputs[0])

    def _weight(self, weight: ir.Value, graph: ir.Graph) -> tuple[ir.Value, ir.Value]:
        tensor = weight.const_value
        if tensor is None or tensor.dtype != ir.DataType.FLOAT:
            raise ConfigError(f"--weights w8a8: the weight {weight.name!r} is not a float32 "
                              "constant", hint="w8a8 quantizes float32 models "
                              "(MatMulIntegerToFloat gives float32); int4 or int8 for "
                              "float16 ones")
        array = tensor.numpy().astype(np.float32)
        array = array.reshape(array.shape[-2:])
        scale = np.maximum(np.abs(array).max(axis=0), np.float32(1e-30)) / np.float32(127)
        levels = np.clip(np.rint(array / scale), -127, 127).astype(np.int8)
        home = weight.graph or graph
        made = []
        for name, values in ((weight.name + SUFFIX, levels),
                             (weight.name + SUFFIX + "_scales", scale.astype(np.float32))):
            value = ir.Value(name=name, const_value=ir.tensor(values, name=name))
            home.register_initializer(value)
            made.append(value)
        self.quantized.add(weight.name)
        return made[0], made[1]

    def _rows(self, x: ir.Value) -> tuple[list[ir.Node], tuple[ir.Value, ir.Value]]:
        """The nodes quantizing ``x`` per row; its codes and scales."""
        c = self.constants

        def step(op: str, inputs: list, what: str, attributes=None) -> ir.Node:
            kind = ir.TensorType(ir.DataType.UINT8) if op == "Cast" else FLOAT
            made = ir.node(op, inputs, attributes, name=f"{x.name}{PREFIX}{what}",
                           outputs=[ir.Value(name=f"{x.name}{PREFIX}{what}", type=kind)])
            nodes.append(made)
            return made.outputs[0]

        nodes: list[ir.Node] = []
        size = step("Abs", [x], "abs")
        peak = step("ReduceMax", [size, c["axes"]], "max", {"keepdims": 1}) \
            if self.opset >= 18 else step("ReduceMax", [size], "max", {"axes": [-1], "keepdims": 1})
        scale = step("Mul", [step("Max", [peak, c["eps"]], "max_eps"), c["inv127"]], "scale")
        rounded = step("Round", [step("Div", [x, scale], "scaled")], "rounded")
        shifted = step("Add", [rounded, c["f128"]], "shifted")
        return nodes, (step("Cast", [shifted], "codes", {"to": ir.DataType.UINT8}), scale)


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The [K, N] float weight a MatMulIntegerToFloat of this module multiplies by."""
    return codes.astype(np.float32) * scales.astype(np.float32)
