"""RMSNorm (and the residual Add before it) onto ORT's SimplifiedLayerNormalization kernels:
structure, parity on ORT, and the near misses that must stay as they are."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.optimizer import remove_unused_nodes

from mha_onnx.graph.files import check_structure
from mha_onnx.rewrite.tighten.norms import fuse_norms, omit_unread_outputs
from mha_onnx.runtime.ort import OrtRunner

F = TensorProto.FLOAT
DIM = 16


def _norm(x: str, out: str, axes=(-1,), reciprocal=False, weight_shape=(DIM,)) -> list:
    w = numpy_helper.from_array(np.linspace(0.5, 1.5, int(np.prod(weight_shape)), dtype=np.float32)
                                .reshape(weight_shape), f"{out}_w")
    nodes = [
        helper.make_node("Constant", [], [f"{out}_two"], value_float=2.0),
        helper.make_node("Pow", [x, f"{out}_two"], [f"{out}_sq"]),
        helper.make_node("Constant", [], [f"{out}_axes"], value_ints=list(axes)),
        helper.make_node("ReduceMean", [f"{out}_sq", f"{out}_axes"], [f"{out}_mean"], keepdims=1),
        helper.make_node("Constant", [], [f"{out}_eps"], value_float=1e-6),
        helper.make_node("Add", [f"{out}_mean", f"{out}_eps"], [f"{out}_var"]),
        helper.make_node("Sqrt", [f"{out}_var"], [f"{out}_root"]),
    ]
    if reciprocal:
        nodes.append(helper.make_node("Reciprocal", [f"{out}_root"], [f"{out}_inv"]))
    else:
        nodes += [helper.make_node("Constant", [], [f"{out}_one"], value_float=1.0),
                  helper.make_node("Div", [f"{out}_one", f"{out}_root"], [f"{out}_inv"])]
    nodes += [helper.make_node("Mul", [x, f"{out}_inv"], [f"{out}_n"]),
              helper.make_node("Cast", [f"{out}_n"], [f"{out}_c"], to=F),
              helper.make_node("Mul", [f"{out}_w", f"{out}_c"], [out])]
    return nodes, w


def _model(**kw) -> onnx.ModelProto:
    """h = a + b (the residual, also an output), y = rmsnorm(h)."""
    nodes, w = _norm("h", "y", **kw)
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["h"]), *nodes], "g",
                              [helper.make_tensor_value_info(n, F, ["B", "S", DIM]) for n in "ab"],
                              [helper.make_tensor_value_info(n, F, ["B", "S", DIM]) for n in "yh"],
                              initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _run(model: onnx.ModelProto, feeds):
    with OrtRunner(model.SerializeToString()) as runner:
        return runner.infer(feeds)


@pytest.mark.parametrize("reciprocal", [False, True], ids=["div", "reciprocal"])
def test_rms_norm_and_residual_fuse(reciprocal):
    original = _model(reciprocal=reciprocal)
    model = ir.from_proto(original)
    assert fuse_norms(model) == 2
    remove_unused_nodes(model)
    common_passes.NameFixPass()(model)  # (as fuse does, before the unread outputs go)
    omit_unread_outputs(model.graph)
    fused = ir.to_proto(model)
    ops = [(n.domain, n.op_type) for n in fused.graph.node]
    assert ops == [("com.microsoft", "SkipSimplifiedLayerNormalization")]
    # the mean and 1/std nothing reads are not asked for (ORT's kernel skips writing them)
    outputs = list(fused.graph.node[0].output)
    assert outputs[1:3] == ["", ""] and outputs[0] == "y" and outputs[3] == "h"
    check_structure(fused)  # ORT's ops are not refused by the checker
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((2, 5, DIM)).astype(np.float32) for n in "ab"}
    got, want = _run(fused, feeds), _run(original, feeds)
    for name in "yh":
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [{"axes": (1,)}, {"weight_shape": (1, DIM)}],
                         ids=["mean over another axis", "weight not a vector"])
def test_near_misses_stay(kw):
    model = ir.from_proto(_model(**kw))
    assert fuse_norms(model) == 0
    assert "SimplifiedLayerNormalization" not in [n.op_type for n in model.graph]


def _layer_norm_model(elem=F, residual_out: bool = False, read_twice: bool = False
                      ) -> onnx.ModelProto:
    """y = LayerNormalization(a + b), a and b both [B, S, DIM]: what ORT fuses into
    SkipLayerNormalization (BERT's post-norm residual; z = y * y, the next layer)."""
    np_type = onnx.helper.tensor_dtype_to_np_dtype(elem)
    weights = [numpy_helper.from_array(np.linspace(0.5, 1.5, DIM).astype(np_type), "g"),
               numpy_helper.from_array(np.linspace(-0.2, 0.2, DIM).astype(np_type), "beta")]
    nodes = [helper.make_node("Add", ["a", "b"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "beta"], ["y"], axis=-1),
             helper.make_node("Mul", ["h" if read_twice else "y", "y"], ["z"])]
    outputs = ["y", "z", "h"] if residual_out else ["y", "z"]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, elem, ["B", "S", DIM]) for n in "ab"],
        [helper.make_tensor_value_info(n, elem, ["B", "S", DIM]) for n in outputs], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _ort_ops(model: onnx.ModelProto, tmp_path) -> list[str]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]


def test_a_float32_residual_before_layer_norm_is_a_sum_ort_does_not_fuse(tmp_path):
    """ORT fuses Add -> LayerNormalization into SkipLayerNormalization (1.5-5.5x slower on the
    CPU in float32, tools/experiments/skip_norm.py); written as Sum it runs the two fast
    kernels, with the same outputs."""
    from mha_onnx.rewrite.tighten.norms import residual_sums

    model = _layer_norm_model()
    assert "SkipLayerNormalization" in _ort_ops(model, tmp_path)  # what the change avoids
    graph = ir.from_proto(model)
    assert residual_sums(graph) == 1
    after = ir.to_proto(graph)
    assert [n.op_type for n in after.graph.node][0] == "Sum"
    assert "SkipLayerNormalization" not in _ort_ops(after, tmp_path)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((2, 5, DIM)).astype(np.float32) for n in "ab"}
    want, got = _run(model, feeds), _run(after, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["float16", "residual is an output", "residual read twice"])
def test_residuals_left_as_they_are(case):
    """float16 (ORT's CPU runs it through Casts and fuses nothing; Sum is no faster), an Add
    whose sum is a graph output (its name is the interface), or is read by more than the
    norm (ORT does not fuse that one, and Add is faster than Sum)."""
    from mha_onnx.rewrite.tighten.norms import residual_sums

    model = {"float16": lambda: _layer_norm_model(TensorProto.FLOAT16),
             "residual is an output": lambda: _layer_norm_model(residual_out=True),
             "residual read twice": lambda: _layer_norm_model(read_twice=True)}[case]()
    assert residual_sums(ir.from_proto(model)) == 0


def test_a_norm_output_something_reads_stays_named():
    """The 1/std a graph returns (or reads) is kept; the mean nothing reads goes."""
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["a", "b", "w"],
                            ["y", "mean", "inv_std", "h"], domain="com.microsoft")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, F, ["B", "S", DIM]) for n in "ab"],
        [helper.make_tensor_value_info("y", F, ["B", "S", DIM]),
         helper.make_tensor_value_info("inv_std", F, ["B", "S", 1])],
        [numpy_helper.from_array(np.ones(DIM, np.float32), "w")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)], ir_version=9))
    omit_unread_outputs(model.graph)
    assert list(ir.to_proto(model).graph.node[0].output) == ["y", "", "inv_std", "h"]
