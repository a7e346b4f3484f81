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


def test_a_log_of_0_is_no_overflow_and_ranges_need_no_reference(tmp_path):
    """T5's relative position buckets: the log of 0, its -inf dropped by a Where, is the same
    in float32 (a domain's edge, not a value past the range); a file without export metadata
    and without --reference gets its ranges alone, said so."""
    from mha_onnx.parity.ranges import NO_REFERENCE

    nodes = [helper.make_node("Sub", ["x", "x"], ["zero"]),
             helper.make_node("Log", ["zero"], ["log"], name="log_of_0"),
             helper.make_node("Less", ["log", "low"], ["edge"]),
             helper.make_node("Where", ["edge", "x", "log"], ["y"], name="dropped")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["B", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["B", 8])],
        [numpy_helper.from_array(np.array(-60000, np.float16), "low")])
    path = tmp_path / "t5_buckets.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                ir_version=9), path)
    report = validate_model(path, ValidateConfig(ranges=True))
    assert report.exit_code == EXIT_OK, report.render()
    assert report.ranges.overflow is None and not report.references
    assert NO_REFERENCE in report.notes
    with pytest.raises(Exception, match="no mha-onnx metadata"):  # (a comparison needs one)
        validate_model(path, ValidateConfig())


def _mlp(path, weight: np.ndarray) -> None:
    """x [B, 8] float16 -> MatMul(w) -> Add(x) = y; the MatMul carries the module scope
    torch.export records."""
    with np.errstate(over="ignore"):  # (the unfit case: a value past float16's largest)
        w = numpy_helper.from_array(weight.astype(np.float16), "w")
    matmul = helper.make_node("MatMul", ["x", "w"], ["h"], name="node_linear_13")
    matmul.metadata_props.add(key="pkg.torch.onnx.name_scopes",
                              value="['', 'inner', 'inner.model.layers.1.mlp.down_proj', "
                                    "'linear_13']")
    graph = helper.make_graph(
        [matmul, helper.make_node("Add", ["h", "x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["B", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["B", 8])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                ir_version=9), path)


def test_a_float16_export_that_overflows_is_refused_with_its_layer(tmp_path):
    """export --dtype float16's check (what it runs when its outputs hold inf/NaN): the
    MatMul named with its module, whether its activations pass 65504 or its weight itself
    did not fit float16; "please report" nowhere."""
    from mha_onnx.errors import FusionError
    from mha_onnx.export.overflow import overflow_refused

    loud = tmp_path / "loud.onnx"
    _mlp(loud, np.full((8, 8), 30000.0))
    with pytest.raises(FusionError, match="makes inf/NaN from finite inputs") as caught:
        overflow_refused(loud, ["logits"], lambda _: None)
    assert "node_linear_13 [model.layers.1.mlp.down_proj] (MatMul)" in caught.value.message
    assert "please report" not in caught.value.message + (caught.value.hint or "")
    unfit = tmp_path / "unfit.onnx"
    weight = np.full((8, 8), 0.5)
    weight[0, 0] = 1e6  # past float16's largest: inf in the file
    _mlp(unfit, weight)
    with pytest.raises(FusionError, match="reads w, a constant holding inf/NaN"):
        overflow_refused(unfit, ["logits"], lambda _: None)
    quiet = tmp_path / "quiet.onnx"
    _mlp(quiet, np.full((8, 8), 0.01))
    overflow_refused(quiet, ["the export's outputs"], lambda _: None)  # nothing found: as was
