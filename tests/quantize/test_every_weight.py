"""Every MatMul of a constant weight quantized or named: a tied LM head (a MatMul over the
Transpose of the embedding table) gets its own quantized copy, MatMuls named alike in two If
branches count twice, and whatever stays float is listed by name with why."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.quantize.weights import QuantizeConfig, float_left, quantize_weights
from mha_onnx.runtime.ort import OrtRunner

V, D = 64, 32


def _tied(branches: bool = False) -> onnx.ModelProto:
    """ids -> Gather(embedding) -> MatMul(w) -> MatMul(Transpose(embedding)) = logits;
    ``branches``: the MatMul(w) inside both branches of an If, one node name in each."""
    rng = np.random.default_rng(0)
    f = TensorProto.FLOAT
    inits = [numpy_helper.from_array(rng.standard_normal((V, D)).astype(np.float32), "embed"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "w")]
    project = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj")]
    if branches:
        def branch(name):
            return helper.make_graph(
                [helper.make_node("MatMul", ["x", "w"], ["hb"], name="proj")], name, [],
                [helper.make_tensor_value_info("hb", f, None)])
        project = [helper.make_node("If", ["flag"], ["h"], then_branch=branch("then"),
                                    else_branch=branch("else"))]
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["x"]), *project,
             helper.make_node("Transpose", ["embed"], ["head"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "head"], ["logits"], name="lm_head")]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])]
    if branches:
        inputs.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("logits", f, ["B", "S", V])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _ops(model: onnx.ModelProto) -> list[str]:
    from mha_onnx.graph.walk import all_nodes

    return [n.op_type for n in all_nodes(model.graph)]


def test_a_tied_head_is_quantized_as_its_own_and_the_embedding_stays_float():
    model = _tied()
    result = quantize_weights(model, QuantizeConfig())
    ops = _ops(result.model)
    assert "MatMul" not in ops and ops.count("MatMulNBits") == 2
    assert "embed" in {t.name for t in result.model.graph.initializer}  # (the Gather's)
    assert result.matmuls() == {"proj": 4, "lm_head": 4} and not result.left
    assert any("tied LM head" in note for note in result.notes)
    ids = np.array([[1, 5, 9]], np.int64)
    want = OrtRunner(model.SerializeToString()).infer({"ids": ids})["logits"]
    got = OrtRunner(result.model.SerializeToString()).infer({"ids": ids})["logits"]
    cosine = float((want * got).sum() / np.linalg.norm(want) / np.linalg.norm(got))
    assert cosine > 0.99


def test_matmuls_named_alike_in_two_branches_count_twice():
    result = quantize_weights(_tied(branches=True), QuantizeConfig())
    assert sorted(result.matmuls().items()) == [("lm_head", 4), ("proj@graph1", 4),
                                                ("proj@graph2", 4)]
    assert _ops(result.model).count("MatMulNBits") == 3


def test_what_stays_float_is_named_with_why():
    excluded = quantize_weights(_tied(), QuantizeConfig(exclude=("lm_head",)))
    assert excluded.left == (("lm_head", "excluded"),)
    assert excluded.matmuls() == {"proj": 4, "lm_head": 0}
    # a weight computed from a constant another way (a Reshape of it): named, not hidden
    model = _tied()
    for node in model.graph.node:
        if node.op_type == "Transpose":
            node.op_type, node.input[:] = "Reshape", ["embed", "shape"]
            del node.attribute[:]
    model.graph.initializer.append(numpy_helper.from_array(np.array([D, V], np.int64), "shape"))
    result = quantize_weights(model, QuantizeConfig())
    assert result.left == (("lm_head", "its weight is computed from a constant through "
                                       "Reshape"),)
    assert result.matmuls() == {"proj": 4, "lm_head": 0}
    assert float_left(result.model) == list(result.left)


def test_first_last_without_layers_in_the_names_is_said_not_silent():
    result = quantize_weights(_tied(), QuantizeConfig(first_last=True))
    assert any("--mixed first-last: no MatMul" in note for note in result.notes)
    assert set(result.matmuls().values()) == {4}
