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
of zeros: a tiny scale, codes 128), Mul, Div, Round, Add, Cast, shared by every MatMul that
reads it; per MatMul: MatMulIntegerToFloat (A's scale 1, B's per column) and a Mul by the
rows' scales.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mha_onnx.errors import ConfigError

PREFIX = "w8a8_"
SUFFIX = "_Q8rows"  # the int8 codes' name: <weight>_Q8rows (sensitivity.read_back finds them)


def _constants(opset: int) -> list[onnx.TensorProto]:
    f32 = np.float32
    values = {"eps": f32(1e-30), "inv127": f32(1 / 127), "f128": f32(128), "one": f32(1),
              "zero_point": np.uint8(128)}
    tensors = [numpy_helper.from_array(np.array(v), PREFIX + k) for k, v in values.items()]
    if opset >= 18:
        tensors.append(numpy_helper.from_array(np.array([-1], np.int64), PREFIX + "axes"))
    return tensors


class RowInt8Quantizer:
    """Replaces one MatMul at a time (``quantize(node, stack)``, the interface of ONNX
    Runtime's node quantizers): a weight read by several MatMuls is quantized once, into the
    graph that holds it; an activation several read is quantized once per graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                          17)
        model.graph.initializer.extend(_constants(self.opset))
        self.weights: dict[str, tuple[str, str]] = {}
        self.rows: dict[tuple[int, str], tuple[str, str]] = {}

    def quantize(self, node: onnx.NodeProto, stack: list[onnx.GraphProto]
                 ) -> list[onnx.NodeProto]:
        codes, scales = self._weight(node.input[1], stack)
        made: list[onnx.NodeProto] = []
        key = (id(stack[-1]), node.input[0])
        if key not in self.rows:
            made, self.rows[key] = self._rows(node.input[0], f"{node.name or node.output[0]}")
        x_codes, x_scales = self.rows[key]
        product = f"{node.output[0]}{PREFIX}product"
        return made + [
            helper.make_node("MatMulIntegerToFloat",
                             [x_codes, codes, PREFIX + "one", scales, PREFIX + "zero_point"],
                             [product], name=f"{node.name}_Q8", domain="com.microsoft"),
            helper.make_node("Mul", [product, x_scales], [node.output[0]],
                             name=f"{node.name}_Q8_rows")]

    def _weight(self, name: str, stack: list[onnx.GraphProto]) -> tuple[str, str]:
        if name in self.weights:
            return self.weights[name]
        tensor, home = next(((t, g) for g in reversed(stack) for t in g.initializer
                             if t.name == name), (None, None))
        if tensor is None or tensor.data_type != onnx.TensorProto.FLOAT:
            raise ConfigError(f"--weights w8a8: the weight {name!r} is not a float32 constant",
                              hint="w8a8 quantizes float32 models (MatMulIntegerToFloat "
                                   "gives float32); int4 or int8 for float16 ones")
        weight = numpy_helper.to_array(tensor).astype(np.float32)
        weight = weight.reshape(weight.shape[-2:])
        scale = np.maximum(np.abs(weight).max(axis=0), np.float32(1e-30)) / np.float32(127)
        codes = np.clip(np.rint(weight / scale), -127, 127).astype(np.int8)
        names = (name + SUFFIX, name + SUFFIX + "_scales")
        home.initializer.extend([numpy_helper.from_array(codes, names[0]),
                                 numpy_helper.from_array(scale.astype(np.float32), names[1])])
        self.weights[name] = names
        return names

    def _rows(self, x: str, at: str) -> tuple[list[onnx.NodeProto], tuple[str, str]]:
        """The nodes quantizing ``x`` per row; (codes, scales) names."""
        p = f"{x}{PREFIX}"
        reduce = helper.make_node("ReduceMax", [p + "abs", PREFIX + "axes"], [p + "max"],
                                  keepdims=1, name=f"{at}_Q8_max") if self.opset >= 18 else \
            helper.make_node("ReduceMax", [p + "abs"], [p + "max"], axes=[-1], keepdims=1,
                             name=f"{at}_Q8_max")
        steps = [("Abs", [x], "abs"), None, ("Max", [p + "max", PREFIX + "eps"], "max_eps"),
                 ("Mul", [p + "max_eps", PREFIX + "inv127"], "scale"),
                 ("Div", [x, p + "scale"], "scaled"), ("Round", [p + "scaled"], "rounded"),
                 ("Add", [p + "rounded", PREFIX + "f128"], "shifted")]
        nodes = [reduce if step is None else
                 helper.make_node(step[0], step[1], [p + step[2]], name=f"{at}_Q8_{step[2]}")
                 for step in steps]
        nodes.append(helper.make_node("Cast", [p + "shifted"], [p + "codes"],
                                      to=onnx.TensorProto.UINT8, name=f"{at}_Q8_codes"))
        return nodes, (p + "codes", p + "scale")


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The [K, N] float weight a MatMulIntegerToFloat of this module multiplies by."""
    return codes.astype(np.float32) * scales.astype(np.float32)
