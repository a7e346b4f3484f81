"""The one subgraph walk (graph/walk.py for ONNX files, irutil's for onnx-ir): every graph
and node at any depth, If branches and Loop bodies, initializers held by a branch."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.graph.files import all_initializers
from mha_onnx.graph.walk import all_graphs, all_nodes, subgraphs
from mha_onnx.rewrite import irutil


def _nested() -> onnx.ModelProto:
    """If(c): [Loop whose body adds a constant] | [Identity]; the Loop's body holds ``k``."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    body = helper.make_graph(
        [helper.make_node("Add", ["x_in", "k"], ["x_out"], name="body_add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(np.ones(2, np.float32), "k")])
    then = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y_then"], name="loop", body=body)],
        "then", [], [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y_else"], name="ident")],
                              "else", [], [helper.make_tensor_value_info("y_else",
                                                                         TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)],
        "main", [x, helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(np.array(3, np.int64), "n")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_every_graph_and_node_at_any_depth_in_order():
    model = _nested()
    # (helper.make_node writes attributes sorted by name: else_branch first)
    assert [g.name for g in all_graphs(model.graph)] == ["main", "else", "then", "body"]
    assert [n.name for n in all_nodes(model.graph)] == ["if", "ident", "loop", "body_add",
                                                        "body_cond"]
    assert [g.name for g in subgraphs(model.graph.node[0])] == ["else", "then"]
    assert set(all_initializers(model.graph)) == {"n", "k"}  # the Loop body's own included


def test_the_onnx_ir_walk_sees_the_same_graphs():
    model = ir.from_proto(_nested())
    assert [g.name for g in irutil.all_graphs(model.graph)] == ["main", "else", "then", "body"]
    node = next(iter(model.graph))
    assert [g.name for g in irutil.subgraphs(node)] == ["else", "then"]
    assert irutil.subgraphs(next(iter(irutil.subgraphs(node)[0]))) == []
