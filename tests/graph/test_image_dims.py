"""Image sizes from the declared dims and the graph: an OCR-like recogniser ([N, 3, 8, W]: a
Conv stack, the height averaged away, attention over W / 2 columns) runs at W = 3, where its
attention sees one token; the sweep takes a width where it sees MIN_TOKENS, and a real input
of any width the declared dims admit is accepted."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mha_onnx.errors import InputSpecError
from mha_onnx.graph.images import MIN_TOKENS
from mha_onnx.graph.inputs import input_specs, load_feeds
from mha_onnx.parity import ValidateConfig, validate_model


def _recogniser(height) -> onnx.ModelProto:
    """x [n, 3, height, w] -> Conv(3 -> 8, 3x3, stride 2) -> mean over H -> [n, W', 8] ->
    softmax(x x^T) x."""
    f, i = TensorProto.FLOAT, TensorProto.INT64
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.2
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["c", "h_axis"], ["m"], keepdims=0),  # [n, 8, W']
             helper.make_node("Transpose", ["m"], ["t"], perm=[0, 2, 1]),  # [n, W', 8]
             helper.make_node("Transpose", ["t"], ["tt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "tt"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["probs", "t"], ["out"])]
    graph = helper.make_graph(
        nodes, "ocr", [helper.make_tensor_value_info("x", f, ["n", 3, height, "w"])],
        [helper.make_tensor_value_info("out", f, ["n", "cols", 8])],
        [onnx.numpy_helper.from_array(weight, "w"), helper.make_tensor("h_axis", i, [1], [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("height", [8, "h"], ids=["declared height", "symbolic height"])
def test_an_image_is_sized_for_its_attention_and_real_sizes_are_accepted(tmp_path, height):
    model = _recogniser(height)
    (spec,) = input_specs(model)
    assert spec.declared == ("n", 3, height, "w")
    h, w = spec.dims[2:]
    if height == 8:
        assert h == 8  # the declared size kept
    assert (w + 1) // 2 >= MIN_TOKENS  # the columns the attention sees (stride 2)
    real = np.zeros((1, 3, 8, 320), np.float32)
    assert load_feeds({"x": real}, [spec])["x"].shape == (1, 3, 8, 320)
    if height == 8:
        with pytest.raises(InputSpecError, match="wants"):
            load_feeds({"x": np.zeros((1, 3, 9, 320), np.float32)}, [spec])
    path, inputs = tmp_path / "ocr.onnx", tmp_path / "real.npz"
    onnx.save(model, path)
    np.savez(inputs, x=np.random.default_rng(1).standard_normal((2, 3, 8, 320)).astype(
        np.float32))
    report = validate_model(path, ValidateConfig(reference=str(path), inputs=str(inputs)))
    assert report.comparisons and report.exit_code == 0, report.render()
