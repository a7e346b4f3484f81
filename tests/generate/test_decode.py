"""decode.py on small graphs: every If of the main graph replaced by its then branch, the
guard an output, what nothing reads dropped; the same outputs as the graph with its Ifs
where the guard holds."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from mha_onnx.generate.decode import GUARD, decode_graph, inline_ifs
from mha_onnx.runtime.ort import OrtRunner


def _branch(name: str, nodes: list, outputs: list[str]) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [
        helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])


def _model(conditions: tuple[str, str]) -> onnx.ModelProto:
    """Two Ifs: the first's then branch gives ``x`` back (through an Identity: ORT refuses an
    outer value as a branch output) and reads it, one of its nodes named as a main-graph
    node; the second's reads the first's outputs and names a value as the first's does
    (names are unique per graph and its scope only: torch.export repeats them); unread Sins
    in the main graph."""
    first = helper.make_node("If", [conditions[0]], ["a", "b"], then_branch=_branch(
        "t1", [helper.make_node("Identity", ["x"], ["i"]),
               helper.make_node("Neg", ["x"], ["t"], name="sin"),  # (a main graph's node name)
               helper.make_node("Abs", ["t"], ["n"])], ["i", "n"]), else_branch=_branch(
        "e1", [helper.make_node("Abs", ["x"], ["p"]), helper.make_node("Relu", ["x"], ["q"])],
        ["p", "q"]))
    second = helper.make_node("If", [conditions[1]], ["y"], then_branch=_branch(
        "t2", [helper.make_node("Add", ["a", "b"], ["t"]),  # (the first branch's value name)
               helper.make_node("Neg", ["t"], ["s"])], ["s"]), else_branch=_branch(
        "e2", [helper.make_node("Sub", ["a", "b"], ["d"])], ["d"]))
    graph = helper.make_graph(
        [helper.make_node("Sin", ["x"], ["unread2"], name="sin2"),
         helper.make_node("Sin", ["x"], ["unread"], name="sin"),
         helper.make_node("Not", ["c"], ["nc"]),
         first, second], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_the_then_branches_inlined_give_the_outputs_the_guard_admits():
    model = _model(("c", "c"))
    decode = decode_graph(model)
    assert decode is not None
    assert [n.op_type for n in decode.graph.node] == ["Identity", "Neg", "Abs", "Add", "Neg",
                                                      "Identity"]
    assert [o.name for o in decode.graph.output] == ["y", GUARD]
    inlined = inline_ifs(model).graph.node
    names = [n.name for n in inlined if n.name]
    assert len(set(names)) == len(names)  # the branch's "sin" renamed ("sin" is taken)
    assert [n.name for n in inlined if n.op_type == "Sin"] == ["sin2", "sin"]
    made = [o for n in decode.graph.node for o in n.output]
    assert len(set(made)) == len(made) and made.count("t") == 1  # the two branches' "t"
    x = np.array([-1.5, 0.25, 2.0], np.float32)
    steps = OrtRunner(decode.SerializeToString(), "cpu")
    full = OrtRunner(model.SerializeToString(), "cpu")
    for c in (True, False):
        got = steps.infer({"x": x, "c": np.array(c)})
        assert bool(got[GUARD]) is c
        if c:  # (where the guard fails the outputs are not the file's: the caller refuses)
            np.testing.assert_array_equal(got["y"], full.infer({"x": x, "c": np.array(c)})["y"])


def test_ifs_on_different_conditions_or_none_are_left_alone():
    assert decode_graph(_model(("c", "nc"))) is None
    plain = helper.make_model(helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])]),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert decode_graph(plain) is None
