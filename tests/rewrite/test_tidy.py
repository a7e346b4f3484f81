"""tidy.share_guards: two layers' guards, read from different tensors of the same symbolic
shape, become one computation; a constant CastLike becomes a Cast ORT can fold."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from mha_onnx.rewrite.tighten.tidy import share_guards
from mha_onnx.runtime.ort import OrtRunner


def _model() -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"])]
    for n, source in enumerate(("a", "b")):  # each "layer": is its sequence length 1?
        nodes += [
            helper.make_node("Shape", [source], [f"s{n}"], start=1, end=2),
            helper.make_node("Constant", [], [f"one{n}"], value=helper.make_tensor(
                f"one{n}", TensorProto.INT64, [1], [1])),
            helper.make_node("Equal", [f"s{n}", f"one{n}"], [f"g{n}"]),
        ]
    nodes += [
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor(
            "zero", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("CastLike", ["zero", "mask"], ["zero_like"]),
        helper.make_node("Equal", ["mask", "zero_like"], ["padded"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])
    mask = helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"])
    outputs = [helper.make_tensor_value_info(name, TensorProto.BOOL, None)
               for name in ("g0", "g1", "padded")]
    graph = helper.make_graph(nodes, "g", [x, mask], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


def test_equal_guards_of_two_layers_become_one():
    original = _model()
    model = ir.from_proto(original)
    assert share_guards(model) == 2  # both Shapes now read the input x
    after = ir.to_proto(model)
    ops = [n.op_type for n in after.graph.node if n.op_type != "Constant"]
    assert ops.count("Shape") == 1 and ops.count("Equal") == 2  # one guard, one padding test
    assert "CastLike" not in ops and "Cast" in ops
    for seq in (1, 3):
        feeds = {"x": np.ones((2, seq, 4), np.float32),
                 "mask": np.array([[1] * seq, [0] * seq], np.int64)}
        want = OrtRunner(original.SerializeToString(), "cpu").infer(feeds)
        got = OrtRunner(after.SerializeToString(), "cpu").infer(feeds)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
