"""packing: MatMuls of one input with constant weights become one MatMul and a Split, with
the same outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.rewrite.packing import pack, projections
from mha_onnx.runtimes import OrtRunner


def _model(widths: list[int], other_input: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((8, w)).astype(np.float32), f"w{i}")
               for i, w in enumerate(widths)]
    nodes = [helper.make_node("MatMul", ["y" if other_input and i else "x", f"w{i}"],
                              [f"out{i}"]) for i in range(len(widths))]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "S", 8])
              for n in ("x", "y")]
    outputs = [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, None)
               for i in range(len(widths))]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def test_three_projections_of_one_input_are_one_matmul():
    model = _model([16, 4, 4])
    packed = ir.from_proto(model)
    nodes = projections([out.producer().outputs[0] for out in packed.graph.outputs])
    whole, where = pack(nodes)
    assert whole.producer().op_type == "MatMul"
    assert {name: columns for name, (_, *columns) in where.items()} == \
        {"w0": [0, 16], "w1": [16, 20], "w2": [20, 24]}
    assert len({joined for joined, _, _ in where.values()}) == 1
    after = ir.to_proto(packed)
    assert [n.op_type for n in after.graph.node] == ["MatMul", "Split"]
    assert [o.name for o in after.graph.output] == ["out0", "out1", "out2"]
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((2, 3, 8)).astype(np.float32) for n in ("x", "y")}
    want = OrtRunner(model.SerializeToString(), "cpu").infer(feeds)
    got = OrtRunner(after.SerializeToString(), "cpu").infer(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_projections_of_different_inputs_stay_apart():
    packed = ir.from_proto(_model([16, 4], other_input=True))
    assert projections([out for out in packed.graph.outputs]) is None


def test_a_packed_weight_is_read_back_for_references():
    from mha_onnx.parity.references import _weight

    model = _model([16, 4, 4])
    packed = ir.from_proto(model)
    _, where = pack(projections([out.producer().outputs[0] for out in packed.graph.outputs]))
    after = ir.to_proto(packed)
    arrays = {t.name: t for t in after.graph.initializer if t.name not in where}  # (fuse
    for name, tensor in ((t.name, t) for t in model.graph.initializer):  # drops them)
        np.testing.assert_array_equal(_weight(arrays, where, name),
                                      numpy_helper.to_array(tensor))
    assert _weight(arrays, where, "nowhere") is None
