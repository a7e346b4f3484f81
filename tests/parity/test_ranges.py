"""validate --ranges: each activation's peak against float16's range; the first node that makes
inf out of finite inputs named (a failure, even where the reference overflows alike: NaN
against NaN is no pass here); a mask's -inf fill is not an overflow."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.errors import EXIT_MISMATCH, EXIT_OK
from mha_onnx.parity import ValidateConfig, validate_model


def _model(path, dtype: int, gain: float) -> None:
    """y = Softmax(Where(mask, -inf, (x * gain) * gain)) + x: with float16 and gain 300, the
    second Mul passes 65504 for |x| > 0.73."""
    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    inits = [numpy_helper.from_array(np.array(gain, np_dtype), "gain"),
             numpy_helper.from_array(np.array(-np.inf, np_dtype), "fill"),
             numpy_helper.from_array(np.array(0.5, np_dtype), "half")]
    nodes = [helper.make_node("Mul", ["x", "gain"], ["once"], name="first_gain"),
             helper.make_node("Mul", ["once", "gain"], ["twice"], name="second_gain"),
             helper.make_node("Greater", ["x", "half"], ["mask"]),
             helper.make_node("Where", ["mask", "fill", "twice"], ["filled"], name="fill"),
             helper.make_node("Softmax", ["filled"], ["p"], axis=-1, name="softmax"),
             helper.make_node("Add", ["p", "x"], ["y"], name="out")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, ["B", 8])],
                              [helper.make_tensor_value_info("y", dtype, ["B", 8])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                ir_version=9), path)


def test_a_float16_overflow_is_named_and_fails(tmp_path):
    path = tmp_path / "half.onnx"
    _model(path, TensorProto.FLOAT16, 300.0)
    report = validate_model(path, ValidateConfig(reference=str(path), ranges=True))
    assert report.ranges.overflow is not None and report.ranges.overflow.node == "second_gain"
    assert report.exit_code == EXIT_MISMATCH  # (the reference overflows alike)
    text = report.render()
    assert "FAIL ranges: second_gain (Mul) makes inf/NaN from finite inputs" in text
    assert report.to_dict()["ranges"]["overflow"]["node"] == "second_gain"


def test_a_float32_model_gets_its_peaks_and_passes(tmp_path):
    path = tmp_path / "full.onnx"
    _model(path, TensorProto.FLOAT, 300.0)
    report = validate_model(path, ValidateConfig(reference=str(path), ranges=True))
    assert report.exit_code == EXIT_OK, report.render()
    ranges = report.ranges
    assert ranges.overflow is None and ranges.peaks[0].node == "second_gain"
    assert [p.node for p in ranges.near][:1] == ["second_gain"]  # past 16k: named
    assert "ranges: " in report.render()


@pytest.mark.slow
def test_a_float16_export_that_overflows_is_refused_with_its_layer(tmp_path):
    """A Llama whose second MLP's activations pass 65504 in float16 (PyTorch's float16
    overflows too): export --dtype float16 refuses it, naming the MatMul and its module,
    instead of "please report this model"."""
    import torch
    import transformers as tf
    from click.testing import CliRunner

    from mha_onnx.cli import main

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128))
    with torch.no_grad():
        for weight in (model.model.layers[1].mlp.down_proj.weight,
                       model.model.layers[1].mlp.up_proj.weight):
            weight.mul_(3000.0)
    model.save_pretrained(tmp_path / "hf")
    result = CliRunner().invoke(main, ["export", "--model", str(tmp_path / "hf"), "--dtype",
                                       "float16", "-o", str(tmp_path / "model.onnx")])
    assert result.exit_code == 1, result.output
    assert "hold inf/NaN" in result.output and "model.layers.1.mlp" in result.output
    assert "makes inf/NaN from finite inputs" in result.output
    assert "please report" not in result.output and not (tmp_path / "model.onnx").exists()
