"""packing: MatMuls of one input with constant weights become one MatMul and a Split, with
the same outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.rewrite.tighten.packing import pack, projections
from mha_onnx.runtime.ort import OrtRunner


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
    _same_outputs(model, after, batch=2)


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


# -- pack_kernel_inputs: a GroupQueryAttention reading Q, K and V packed ----------------------

HEADS, GROUPS, HEAD = 4, 2, 8  # Q 32 wide, K and V 16 wide each (ORT: head size % 8 == 0)


def _gqa_model(*, k_bias: bool = False, k_input: str = "x", spare_reader: bool = False,
               k_width: int = GROUPS * HEAD, exporter_packed: str = "") -> onnx.ModelProto:
    """x [B, S, 8] -> Q, K, V (MatMul + bias on Q and V; on K where ``k_bias``) ->
    GroupQueryAttention (causal, no past). ``spare_reader``: another output reads w1 too;
    ``exporter_packed``: "split" / "slices" (one MatMul, its output cut in three) or a gap
    left between the slices ("gap")."""
    rng = np.random.default_rng(0)
    widths = [HEADS * HEAD, k_width, GROUPS * HEAD]
    arrays = {f"w{i}": rng.standard_normal((8, w)).astype(np.float32)
              for i, w in enumerate(widths)}
    arrays.update({f"b{i}": rng.standard_normal(w).astype(np.float32)
                   for i, w in enumerate(widths) if i != 1 or k_bias})
    nodes, qkv = [], []
    if exporter_packed:
        arrays = {"w": np.concatenate([arrays[f"w{i}"] for i in range(3)], 1)}
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["whole"]))
        ends = np.cumsum(widths).tolist()
        if exporter_packed == "split":
            arrays["sizes"] = np.array(widths, np.int64)
            nodes.append(helper.make_node("Split", ["whole", "sizes"], ["q", "k", "v"], axis=-1))
        else:
            gap = 1 if exporter_packed == "gap" else 0
            for i, name in enumerate("qkv"):
                start = (ends[i - 1] if i else 0) + (gap if i == 2 else 0)
                arrays.update({f"s{i}": np.array([start], np.int64),
                               f"e{i}": np.array([ends[i]], np.int64)})
                nodes.append(helper.make_node("Slice", ["whole", f"s{i}", f"e{i}", "axis"],
                                              [name]))
            arrays["axis"] = np.array([-1], np.int64)
        qkv = ["q", "k", "v"]
    else:
        for i, name in enumerate("qkv"):
            source = k_input if i == 1 else "x"
            nodes.append(helper.make_node("MatMul", [source, f"w{i}"], [f"{name}_mm"]))
            if f"b{i}" in arrays:
                nodes.append(helper.make_node("Add", [f"{name}_mm", f"b{i}"], [name]))
                qkv.append(name)
            else:
                qkv.append(f"{name}_mm")
    arrays["seqlens"] = np.array([2], np.int32)  # (batch 1, 3 tokens: seqlens_k = 3 - 1)
    arrays["total"] = np.array(3, np.int32)
    nodes.append(helper.make_node("GroupQueryAttention", [*qkv, "", "", "seqlens", "total"],
                                  ["out", "present_k", "present_v"], domain="com.microsoft",
                                  num_heads=HEADS, kv_num_heads=GROUPS))
    outputs = ["out"]
    if spare_reader:
        nodes.append(helper.make_node("MatMul", ["x", "w1"], ["spare"]))
        outputs.append("spare")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 8])
                     for n in ("x", "y")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(a, n) for n, a in arrays.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def _packed(model: onnx.ModelProto) -> tuple[int, dict, onnx.ModelProto]:
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from mha_onnx.rewrite.tighten.packing import pack_kernel_inputs

    ir_model = ir.from_proto(model)
    kernels, where = pack_kernel_inputs(ir_model)
    RemoveUnusedNodesPass()(ir_model)
    return kernels, where, ir.to_proto(ir_model)


def _same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, batch: int = 1) -> None:
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((batch, 3, 8)).astype(np.float32) for n in ("x", "y")}
    want = OrtRunner(before.SerializeToString(), "cpu").infer(feeds)
    got = OrtRunner(after.SerializeToString(), "cpu").infer(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


def _gqa(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")


def test_a_kernel_reads_its_projections_packed_with_zeros_for_a_missing_bias():
    model = _gqa_model()
    kernels, where, after = _packed(model)
    assert kernels == 1
    assert list(_gqa(after).input[1:3]) == ["", ""]
    assert sorted(n.op_type for n in after.graph.node) == ["Add", "GroupQueryAttention",
                                                           "MatMul"]
    assert {n: span for n, (_, *span) in where.items()} == {
        "w0": [0, 32], "w1": [32, 48], "w2": [48, 64], "b0": [0, 32], "b2": [48, 64]}
    bias = next(t for t in after.graph.initializer if t.name == where["b0"][0])
    np.testing.assert_array_equal(numpy_helper.to_array(bias)[32:48], 0)  # K had none
    assert not {"w0", "w1", "w2", "b0", "b2"} & {t.name for t in after.graph.initializer}
    _same_outputs(model, after)


def test_a_weight_something_else_reads_is_a_slice_of_the_packed_one():
    model = _gqa_model(k_bias=True, spare_reader=True)
    kernels, _, after = _packed(model)
    assert kernels == 1
    assert "w1" not in {t.name for t in after.graph.initializer}  # stored once, packed
    assert "Slice" in {n.op_type for n in after.graph.node}
    _same_outputs(model, after)


def test_projections_the_packed_input_cannot_hold_stay_apart():
    for model in (_gqa_model(k_input="y"),  # K projects another input
                  _gqa_model(k_width=12, k_bias=True)):  # K and V of different widths
        kernels, where, after = _packed(model)
        assert (kernels, where) == (0, {})
        assert _gqa(after).input[1] != ""


def test_the_exporters_own_packing_is_read_before_its_split():
    for how in ("split", "slices"):
        model = _gqa_model(exporter_packed=how)
        kernels, where, after = _packed(model)
        assert (kernels, where) == (1, {}), how
        assert list(_gqa(after).input[:3]) == ["whole", "", ""], how
        assert {n.op_type for n in after.graph.node} == {"MatMul", "GroupQueryAttention"}
        _same_outputs(model, after)
    kernels, _, _ = _packed(_gqa_model(exporter_packed="gap"))  # slices leaving a column out
    assert kernels == 0
