"""The optimizer fuse and export run: onnxscript's clean-up without its near-identity rules
(an epsilon of 1e-8 is not zero), and the RMS normalisations an exporter left without one."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.rewrite.faithful import optimize_faithfully
from mha_onnx.rewrite.fuse import fuse_model
from mha_onnx.rewrite.tighten.norms import unguarded_norms

F = TensorProto.FLOAT


def _binary(op: str, constant: np.ndarray, first: bool = False) -> onnx.ModelProto:
    args = ["c", "x"] if first else ["x", "c"]
    graph = helper.make_graph(
        [helper.make_node(op, args, ["y"])], "g",
        [helper.make_tensor_value_info("x", F, [2, 4])], [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(constant, "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("op, value, first, kept", [
    ("Add", 1e-8, False, True),      # onnxscript's add_0 rule removes this one
    ("Add", 1e-8, True, True),
    ("Sub", -1e-9, False, True),
    ("Mul", 1.000001, False, True),  # within mul_by_1's rel_tol 1e-5
    ("Div", 0.9999999, False, True),
    ("Add", 0.0, True, False),
    ("Sub", 0.0, False, False),
    ("Mul", 1.0, True, False),
    ("Div", 1.0, False, False),
])
def test_only_exact_identities_are_removed(op, value, first, kept):
    model = ir.serde.deserialize_model(_binary(op, np.array(value, np.float32), first))
    optimize_faithfully(model)
    assert any(n.op_type == op for n in model.graph) == kept


def test_a_broadcasting_identity_is_kept():
    """x [2, 4] + zeros [3, 2, 4] is [3, 2, 4]: not a no-op though every value is 0."""
    model = ir.serde.deserialize_model(_binary("Add", np.zeros((3, 2, 4), np.float32)))
    optimize_faithfully(model)
    assert [n.op_type for n in model.graph] == ["Add"]


def _rms(eps: float | None, exponent: float = 2.0) -> onnx.ModelProto:
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"]),
             helper.make_node("Sqrt", ["var" if eps is not None else "mean"], ["root"]),
             helper.make_node("Reciprocal", ["root"], ["inv"]),
             helper.make_node("Mul", ["x", "inv"], ["normed"]),
             helper.make_node("Mul", ["w", "normed"], ["y"])]
    inits = [numpy_helper.from_array(np.array(exponent, np.float32), "two"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(np.float32), "w")]
    if eps is not None:
        nodes.insert(2, helper.make_node("Add", ["mean", "eps"], ["var"]))
        inits.append(numpy_helper.from_array(np.array(eps, np.float32), "eps"))
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", F, ["B", "S", 8])],
                              [helper.make_tensor_value_info("y", F, ["B", "S", 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_fuse_keeps_a_tiny_epsilon_so_zero_rows_stay_zero():
    """Helium's rms_norm_eps=1e-8: a padding token's embedding is a row of zeros."""
    fused, _, _ = fuse_model(_rms(1e-8))
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    x[1, 0] = 0.0
    run = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    y = run.run(None, {"x": x})[0]
    assert np.isfinite(y).all() and not y[1, 0].any()
    norms = [n for n in fused.graph.node if n.op_type == "SimplifiedLayerNormalization"]
    assert [round(a.f, 12) for n in norms for a in n.attribute if a.name == "epsilon"] == [1e-8]


def test_norms_without_an_epsilon_are_found():
    assert unguarded_norms(_rms(None)) == ["root"]  # an unnamed node: by its output
    assert unguarded_norms(_rms(1e-8)) == []
    assert unguarded_norms(_rms(None, exponent=3.0)) == []  # not a mean of squares


def test_constants_a_rewrite_made_under_one_name_are_all_registered():
    """Two Flattens of one value (a mixture of experts' routing): onnxscript's Flatten2Reshape
    names both shapes `{input}/shape` and its rewriter kept one (its issue 2945), leaving the
    second Reshape reading a value nothing produced; ORT refused the fused Qwen3-MoE. Every
    such constant is registered again under a name of its own."""
    from mha_onnx.runtime.ort import OrtRunner

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, 12]) for i in range(3)]
    nodes = [helper.make_node("Flatten", ["x"], [f"y{i}"], axis=1) for i in range(3)]
    proto = helper.make_model(helper.make_graph(nodes, "g", [x], outs),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    model = ir.serde.deserialize_model(proto)
    optimize_faithfully(model)
    fixed = ir.serde.serialize_model(model)
    onnx.checker.check_model(fixed, full_check=True)
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    with OrtRunner(fixed.SerializeToString()) as run:
        got = run.infer({"x": data})
    assert all(np.array_equal(got[f"y{i}"], data.reshape(2, 12)) for i in range(3))
