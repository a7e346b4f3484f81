"""Verification holds a mixture of experts' routes to the original's (rewrite/check/routes.py): a
near-tied router that the fused graph's rounding flips is not a mismatch, a wrong expert
path still is, and both protos come back as they were."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper
from onnx import numpy_helper as nh

from mha_onnx.rewrite.check.routes import chosen_as_inputs, chosen_as_outputs, routes
from mha_onnx.rewrite.check.verify import verify

D = 8


def _moe(score_shift: float = 0.0, expert_error: float = 0.0) -> onnx.ModelProto:
    """x [B, S, D] -> two experts, one chosen per token by TopK(1) over two router scores
    that differ by about 1e-6 (a near-tie everywhere); the chosen expert's output scaled by
    its score. ``score_shift``: added to the second score (what another rounding does);
    ``expert_error``: added to the first expert's weights (a wrong kernel)."""
    rng = np.random.default_rng(0)
    column = rng.normal(size=(D, 1)).astype(np.float32)
    router = np.concatenate([column, column + 1e-6 * rng.normal(size=(D, 1))], axis=1)
    experts = [rng.normal(size=(D, D)).astype(np.float32) for _ in range(2)]
    experts[0] = experts[0] + np.float32(expert_error)
    inits = [nh.from_array(router.astype(np.float32), "router"),
             nh.from_array(experts[0], "w0"), nh.from_array(experts[1], "w1"),
             nh.from_array(np.array([0.0, score_shift], np.float32), "shift"),
             nh.from_array(np.array([1], np.int64), "k"),
             nh.from_array(np.array(0, np.int64), "zero")]
    nodes = [
        helper.make_node("MatMul", ["x", "router"], ["raw"]),
        helper.make_node("Add", ["raw", "shift"], ["scores"]),
        helper.make_node("TopK", ["scores", "k"], ["weight", "choice"], axis=-1,
                         name="router_topk"),
        helper.make_node("MatMul", ["x", "w0"], ["e0"]),
        helper.make_node("MatMul", ["x", "w1"], ["e1"]),
        helper.make_node("Equal", ["choice", "zero"], ["first"]),
        helper.make_node("Where", ["first", "e0", "e1"], ["picked"]),
        helper.make_node("Mul", ["picked", "weight"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "moe", [helper.make_tensor_value_info("x", TP.FLOAT, ["B", "S", D])],
        [helper.make_tensor_value_info("y", TP.FLOAT, ["B", "S", D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_flipped_near_tie_is_not_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    original, fused = _moe(), _moe(score_shift=3e-6)
    held = verify(original, fused)
    assert held.passed and held.routes_held == ("router_topk",)
    monkeypatch.setattr("mha_onnx.rewrite.check.verify.routes", lambda *_: [])
    unheld = verify(original, fused)  # the same graphs, routes not held: tokens flip
    assert not unheld.passed and unheld.worst.stats.max_abs > 0.1


def test_a_wrong_expert_still_fails() -> None:
    result = verify(_moe(), _moe(score_shift=3e-6, expert_error=0.01))
    assert result.routes_held == ("router_topk",) and not result.passed


def test_the_protos_are_put_back() -> None:
    original, fused = _moe(), _moe(score_shift=3e-6)
    before = (original.SerializeToString(), fused.SerializeToString())
    held = routes(original, fused)
    with chosen_as_outputs(original, held) as added, chosen_as_inputs(fused, held):
        assert added == ["choice"] and original.graph.output[-1].name == "choice"
        assert [n.op_type for n in fused.graph.node].count("TopK") == 0
        assert "GatherElements" in [n.op_type for n in fused.graph.node]
        assert fused.graph.input[-1].name == "choice"
    assert (original.SerializeToString(), fused.SerializeToString()) == before


def test_only_routers_both_graphs_hold() -> None:
    original, fused = _moe(), _moe()
    for node in fused.graph.node:
        if node.op_type == "TopK":
            node.output[1] = "renamed"  # not the original's value: not a router of both
    assert routes(original, fused) == []
