"""into_branches.py on small graphs: nodes moved (or copied) into the If branches that read them,
hoisted behind one If where several Ifs share a condition, nested guards merged; every
change checked on ORT against the graph before it, for each value of the conditions."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from mha_onnx.rewrite.tighten.into_branches import (
    hoist_by_condition,
    merge_nested_guards,
    sink_into_branches,
)
from mha_onnx.runtime.ort import OrtRunner

X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])


def _flag(name: str):
    return helper.make_tensor_value_info(name, TensorProto.BOOL, [])


def _branch(name: str, nodes: list, outputs: list[str]) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [
        helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])


def _model(nodes: list, flags: list[str], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [X, *[_flag(f) for f in flags]], [
        helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _if(cond: str, out: str, then: list, then_out: str, other: list, other_out: str):
    return helper.make_node("If", [cond], [out],
                            then_branch=_branch(f"{out}_then", then, [then_out]),
                            else_branch=_branch(f"{out}_else", other, [other_out]))


def _same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, flags: list[str]) -> None:
    x = np.array([-1.5, 0.25, 2.0], np.float32)
    for values in itertools.product([False, True], repeat=len(flags)):
        feeds = {"x": x, **{f: np.array(v) for f, v in zip(flags, values, strict=True)}}
        want = OrtRunner(before.SerializeToString(), "cpu").infer(feeds)
        got = OrtRunner(after.SerializeToString(), "cpu").infer(feeds)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} {values}")


def _apply(model: onnx.ModelProto, change) -> tuple[onnx.ModelProto, int]:
    graph = ir.from_proto(model)
    count = change(graph.graph)
    return ir.to_proto(graph), count


def _main_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_a_node_only_one_branch_reads_moves_into_it():
    model = _model([helper.make_node("Relu", ["x"], ["a"]),
                    helper.make_node("Exp", ["a"], ["b"]),
                    _if("c", "y", [helper.make_node("Neg", ["b"], ["t"])], "t",
                        [helper.make_node("Abs", ["x"], ["e"])], "e")], ["c"], ["y"])
    after, placed = _apply(model, sink_into_branches)
    assert placed == 2 and _main_ops(after) == ["If"]
    _same_outputs(model, after, ["c"])


def test_a_node_both_branches_of_one_if_read_is_copied_into_each():
    model = _model([helper.make_node("Relu", ["x"], ["a"]),
                    _if("c", "y", [helper.make_node("Neg", ["a"], ["t"])], "t",
                        [helper.make_node("Abs", ["a"], ["e"])], "e")], ["c"], ["y"])
    after, _ = _apply(model, sink_into_branches)
    assert _main_ops(after) == ["If"]
    branches = [a.g for a in after.graph.node[0].attribute]
    assert all([n.op_type for n in g.node][0] == "Relu" for g in branches)
    _same_outputs(model, after, ["c"])


@pytest.mark.parametrize("shared", [False, True])
def test_a_node_two_ifs_read_moves_only_where_allowed(shared):
    model = _model([helper.make_node("Relu", ["x"], ["a"]),
                    _if("c", "y", [helper.make_node("Neg", ["a"], ["t"])], "t",
                        [helper.make_node("Abs", ["x"], ["e"])], "e"),
                    _if("d", "z", [helper.make_node("Exp", ["a"], ["t2"])], "t2",
                        [helper.make_node("Abs", ["x"], ["e2"])], "e2")],
                   ["c", "d"], ["y", "z"])
    after, placed = _apply(model, lambda g: sink_into_branches(g, lambda node: shared))
    assert ("Relu" in _main_ops(after)) is not shared and placed == int(shared)
    _same_outputs(model, after, ["c", "d"])


def test_what_every_general_branch_reads_is_computed_behind_one_if():
    general = [helper.make_node("Sin", ["x"], ["s"]), helper.make_node("Exp", ["s"], ["m"])]
    model = _model([*general,
                    _if("c", "y", [helper.make_node("Neg", ["x"], ["t"])], "t",
                        [helper.make_node("Add", ["m", "x"], ["e"])], "e"),
                    _if("c", "z", [helper.make_node("Abs", ["x"], ["t2"])], "t2",
                        [helper.make_node("Mul", ["m", "x"], ["e2"])], "e2")],
                   ["c"], ["y", "z"])
    after, moved = _apply(model, hoist_by_condition)
    assert moved == 2 and _main_ops(after) == ["If", "If", "If"]
    _same_outputs(model, after, ["c"])


def test_a_guard_nested_in_a_fast_branch_merges_with_it():
    inner = _if("d", "w", [helper.make_node("Neg", ["x"], ["t"])], "t",
                [helper.make_node("Abs", ["x"], ["e"])], "e")
    model = _model([helper.make_node("If", ["c"], ["y"],
                                     then_branch=_branch("then", [inner], ["w"]),
                                     else_branch=_branch("else", [
                                         helper.make_node("Exp", ["x"], ["g"])], ["g"]))],
                   ["c", "d"], ["y"])
    after, merged = _apply(model, merge_nested_guards)
    assert merged == 1 and _main_ops(after) == ["And", "If"]
    _same_outputs(model, after, ["c", "d"])


def test_element_types_of_what_is_hoisted_come_from_the_ops():
    from mha_onnx.rewrite.tighten.into_branches import _dtype

    graph = ir.Graph([], [], nodes=[], opset_imports={"": 18})
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT16))
    graph.inputs.append(x)
    tape = ir.tape.Tape()
    shape = tape.op("Shape", [x])
    zeros = tape.op("ConstantOfShape", [shape])
    flags = tape.op("Less", [x, x])
    top = tape.op_multi_out("TopK", [x, tape.op("Constant", [], {"value": ir.tensor(
        np.array([1], np.int64))})], num_outputs=2)
    for value, want in ((tape.op("Neg", [x]), ir.DataType.FLOAT16), (shape, ir.DataType.INT64),
                        (zeros, ir.DataType.FLOAT), (flags, ir.DataType.BOOL),
                        (top[1], None)):
        assert _dtype(value) == want


def test_hoisted_placeholders_do_not_take_names_the_model_has():
    """The hoisted If's unused branch names its placeholders itself: left unnamed, a graph
    names them val_0, val_1, ... which the exporter's values may already be called (BART's
    decoder_with_past from Optimum: ORT refused the model, 'val_5 used as output names
    multiple times')."""
    general = [helper.make_node("Sin", ["x"], ["s"]), helper.make_node("Exp", ["s"], ["m"])]
    model = _model([helper.make_node("Relu", ["x"], ["val_0"]), *general,
                    _if("c", "y", [helper.make_node("Neg", ["val_0"], ["t"])], "t",
                        [helper.make_node("Add", ["m", "x"], ["e"])], "e"),
                    _if("c", "z", [helper.make_node("Abs", ["x"], ["t2"])], "t2",
                        [helper.make_node("Mul", ["m", "val_0"], ["e2"])], "e2")],
                   ["c"], ["y", "z"])
    after, moved = _apply(model, hoist_by_condition)
    assert moved == 2
    _same_outputs(model, after, ["c"])  # ORT loads it
