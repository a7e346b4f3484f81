"""--weights w8a8 (mha_onnx/quantize/w8a8.py): int8 weights per column, int8 activations per
row through ONNX Runtime's integer GEMM. A row's product does not depend on the rows beside
it (a batch's rows are different users' requests: tests/serve/test_engine.py checks their
tokens), the product is close to the float one, a weight several branches read is
quantized once, and the trained fixture passes the gate closer to float than int4 does."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

from mha_onnx.cli import main
from mha_onnx.graph.walk import all_graphs, all_nodes
from mha_onnx.quantize.weights import QuantizeConfig, quantize_weights
from mha_onnx.runtime.ort import OrtRunner
from tests.paths import ROOT

TRAINED = ROOT / "tests" / "fixtures" / "trained" / "llama-onnx" / "model.onnx"


def _two_matmuls(opset: int) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """y = x @ W1, z = x @ W2 (one activation read twice) at ``opset``."""
    rng = np.random.default_rng(opset)
    w1 = rng.standard_normal((64, 48)).astype(np.float32)
    w2 = rng.standard_normal((64, 16)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["y"], name="first"),
         helper.make_node("MatMul", ["x", "w2"], ["z"], name="second")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", 64])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in "yz"],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model, w1, w2


@pytest.mark.parametrize("opset", [17, 18])
def test_each_row_is_quantized_by_itself(opset):
    model, w1, w2 = _two_matmuls(opset)
    made = quantize_weights(model, QuantizeConfig(weights="w8a8"))
    ops = [n.op_type for n in made.model.graph.node]
    assert ops.count("MatMulIntegerToFloat") == 2 and "MatMul" not in ops
    assert ops.count("ReduceMax") == 1  # x quantized once for both products
    assert made.matmuls() == {"first": 8, "second": 8} and not made.left
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    loud = np.concatenate([x, 1e3 * rng.standard_normal((1, 64)).astype(np.float32)])
    with OrtRunner(made.model.SerializeToString()) as runner:
        alone, beside = runner.infer({"x": x}), runner.infer({"x": loud})
        zero = runner.infer({"x": np.zeros((1, 64), np.float32)})
    for name, weight in (("y", w1), ("z", w2)):
        want = x @ weight
        assert np.array_equal(beside[name][:3], alone[name])  # a loud row changes no other
        assert np.abs(alone[name] - want).max() < 0.02 * np.abs(want).max()
        assert not zero[name].any()


def test_a_weight_read_by_several_branches_is_quantized_once(tmp_path):
    from tests.servers import fused

    model = onnx.load(fused("llama", "shared", tmp_path, "w8a8"))
    codes = [t.name for g in all_graphs(model.graph) for t in g.initializer
             if t.name.endswith("_Q8rows")]
    assert codes and len(codes) == len(set(codes))
    readers = [n.input[1] for n in all_nodes(model.graph) if n.op_type == "MatMulIntegerToFloat"]
    assert set(readers) == set(codes)
    assert not [n for n in all_nodes(model.graph) if n.op_type in ("MatMulNBits",)]


def test_the_trained_fixture_passes_closer_to_float_than_int4(tmp_path):
    runs = {}
    for weights in ("w8a8", "int4"):
        result = CliRunner().invoke(main, ["quantize", str(TRAINED), "-o",
                                           str(tmp_path / f"{weights}.onnx"), "--weights",
                                           weights, "--no-sensitivity", "--json"])
        assert result.exit_code == 0, result.output
        runs[weights] = json.loads(result.output)
    w8a8 = runs["w8a8"]
    assert set(w8a8["matmuls"].values()) == {8}
    assert w8a8["accuracy"]["kl_mean"] < runs["int4"]["accuracy"]["kl_mean"] / 10
    assert w8a8["accuracy"]["top1"] > 0.95
    again = CliRunner().invoke(main, ["quantize", str(tmp_path / "w8a8.onnx"), "-o",
                                      str(tmp_path / "twice.onnx"), "--weights", "w8a8"])
    assert again.exit_code == 2 and "already quantized" in again.output


def test_unnamed_matmuls_give_nodes_of_distinct_names():
    """(ORT refuses a graph with two nodes of one name: made from the outputs' names.)"""
    model, w1, _ = _two_matmuls(18)
    for node in model.graph.node:
        node.name = ""
    made = quantize_weights(model, QuantizeConfig(weights="w8a8")).model
    names = [n.name for n in made.graph.node]
    assert len(set(names)) == len(names) and all(names)
    x = np.ones((2, 64), np.float32)
    with OrtRunner(made.SerializeToString()) as runner:
        got = runner.infer({"x": x})["y"]
    assert np.abs(got - x @ w1).max() < 0.02 * np.abs(x @ w1).max()
