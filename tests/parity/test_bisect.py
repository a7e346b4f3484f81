"""`validate --bisect`: the first node whose output differs, against a reference model or the
same model on another provider, inside If branches, in bounded chunks."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.cli import main
from mha_onnx.parity import ValidateConfig, validate_model
from mha_onnx.parity.bisect import BisectReport
from mha_onnx.parity.config import Tolerance

F = TensorProto.FLOAT


def _chain(scale: float = 1.0) -> onnx.ModelProto:
    """x -> MatMul(w1) -> Relu -> MatMul(w2) -> Add(b) -> y; w2 scaled by ``scale``."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 8)).astype(np.float32)
    w2 = rng.standard_normal((8, 8)).astype(np.float32)
    w2[0, 0] *= scale
    b = rng.standard_normal(8).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="first_matmul"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["m"], name="second_matmul"),
             helper.make_node("Add", ["m", "b"], ["y"], name="bias_add")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", F, ["B", 8])],
                              [helper.make_tensor_value_info("y", F, ["B", 8])],
                              [numpy_helper.from_array(a, n) for a, n in
                               ((w1, "w1"), (w2, "w2"), (b, "b"))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _with_if() -> onnx.ModelProto:
    """y = If(c) then MatMul(Relu(x), w) else x; the branch reads x and w from outside."""
    w = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    then = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t0"], name="branch_relu"),
         helper.make_node("MatMul", ["t0", "w"], ["t1"], name="branch_matmul")],
        "then", [], [helper.make_tensor_value_info("t1", F, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e0"])], "else", [],
                              [helper.make_tensor_value_info("e0", F, None)])
    nodes = [helper.make_node("Identity", ["c"], ["c1"], name="cond"),
             helper.make_node("If", ["c1"], ["y"], name="the_if", then_branch=then,
                              else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["B", 8]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F, ["B", 8])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_perturbed_initializer_is_named_through_its_consumer(tmp_path):
    orig, copy = tmp_path / "orig.onnx", tmp_path / "copy.onnx"
    onnx.save(_chain(), orig)
    onnx.save(_chain(scale=1.5), copy)
    result = CliRunner().invoke(main, ["validate", str(copy), "--reference", str(orig),
                                       "--bisect", "--json", "--shapes", "2:1"])
    assert result.exit_code == 1, result.output
    first = json.loads(result.output)["bisect"]["first_divergence"]
    assert (first["node"], first["op_type"], first["output"]) == ("second_matmul", "MatMul", "m")
    errors = {i["value"]: i for i in first["inputs"]}
    assert errors["r"]["max_abs"] == 0 and errors["w2"]["max_abs"] > 0
    assert "initializer" in errors["w2"]["note"]


@pytest.mark.models
def test_chunks_bound_each_run_and_find_the_same_node(tmp_path):
    orig, copy = tmp_path / "orig.onnx", tmp_path / "copy.onnx"
    onnx.save(_chain(), orig)
    onnx.save(_chain(scale=1.5), copy)
    reports = [validate_model(copy, ValidateConfig(reference=str(orig), bisect=True,
                                                   bisect_chunk=chunk, memory_check=False))
               for chunk in (1, 256)]
    one, all_ = (r.bisect for r in reports)
    assert isinstance(one, BisectReport) and isinstance(all_, BisectReport)
    assert one.first.node == all_.first.node == "second_matmul"
    assert one.runs == 6 and all_.runs == 2  # three values a run of one, stopped at the third


def test_without_a_second_graph_it_says_why():
    """Only the PyTorch reference (or a golden file) disagrees and one provider ran: there is
    no second ONNX run to expose values from."""
    from mha_onnx.graph.inputs import ShapeCase
    from mha_onnx.parity.bisect import after_failure
    from mha_onnx.parity.report import Comparison
    from mha_onnx.stats import compare

    case = ShapeCase("2:1", {}, "given")
    failed = Comparison("y", "cpu", "pytorch", case.describe(),
                        compare(np.ones(3, np.float32), np.zeros(3, np.float32)))
    why = after_failure("m.onnx", ValidateConfig(), [failed], [(case, {"x": np.ones(3)})],
                        ["cpu"], dict)
    assert isinstance(why, str) and "--reference" in why


openvino = pytest.importorskip("openvino")
# OpenVINO's bf16 hint runs in bf16 only on CPUs with bf16 units (Intel's AMX/AVX512-BF16);
# an AMD EPYC without them runs it in f32, where nothing diverges to bisect
reduced = pytest.mark.skipif(
    openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string() == "f32",
    reason="this CPU runs OpenVINO's bf16 hint in f32 (no bf16 units)")


@reduced
def test_reduced_precision_names_the_first_diverging_node(tmp_path):
    path = tmp_path / "chain.onnx"
    onnx.save(_chain(), path)
    result = CliRunner().invoke(main, ["validate", str(path), "--reference", str(path),
                                       "--providers", "cpu,openvino-bf16", "--atol", "1e-7",
                                       "--rtol", "0", "--bisect", "--shapes", "4:1"])
    assert result.exit_code == 1, result.output
    assert "bisect (openvino-bf16 vs cpu" in result.output
    assert "first divergence: node 'first_matmul' (MatMul)" in result.output


@reduced
def test_the_branch_an_if_took_is_searched(tmp_path):
    path = tmp_path / "if.onnx"
    onnx.save(_with_if(), path)
    feeds = tmp_path / "in.npz"
    np.savez(feeds, x=np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32),
             c=np.array(True))
    report = validate_model(path, ValidateConfig(
        providers=("cpu", "openvino-bf16"), reference=str(path), inputs=str(feeds),
        tolerances={"*": Tolerance(1e-7, 0.0)}, bisect=True, memory_check=False))
    assert not report
    first = report.bisect.first
    assert (first.node, first.op_type) == ("branch_matmul", "MatMul"), report.render()
    assert first.within == ("If 'the_if' (then)",)
