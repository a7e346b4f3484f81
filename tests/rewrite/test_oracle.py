"""The oracle: which values depend on sizes only, and what size-only masks mean, judged by
evaluating them at several lengths. Near misses (an inverted causal term, a window, a shifted
diagonal, a mask that is causal only below some length) must never read as causal."""

from __future__ import annotations

import pytest
from onnx import helper

from mha_onnx.rewrite.recognise.masks import ScoreDims, SizeLeaf
from mha_onnx.rewrite.recognise.oracle import Oracle
from tests.irgraphs import BOOL, F, Graph, aranges, const, model, node, qkv_inputs, tensor

SQUARE = ScoreDims("B", 2, "S", "S", 4)
CROSS = ScoreDims("B", 2, "S", "T", 4)


def _keep(expr_nodes: list, out: str = "keep", s: str = "S", t: str = "S") -> tuple[Oracle, Graph]:
    g = Graph(model(aranges() + expr_nodes, qkv_inputs(s, t), [out]))
    return Oracle(g.model), g


def _verdict(expr_nodes: list, sd: ScoreDims = SQUARE, masked_when: bool = False, **kw):
    oracle, g = _keep(expr_nodes, s=sd.seq_q, t=sd.seq_kv, **kw)
    return oracle.pattern([SizeLeaf(g["keep"], masked_when, fill=float("-inf"))], sd)


def test_size_only_follows_shapes_not_values():
    g = Graph(model(aranges() + [node("LessOrEqual", ["j", "i"], "keep"),
                                 node("Cast", ["q"], "data", to=BOOL)],
                    qkv_inputs(), ["keep", "data"]))
    oracle = Oracle(g.model)
    assert oracle.size_only(g["keep"]) and oracle.size_only(g["s"])
    assert not oracle.size_only(g["data"]) and not oracle.size_only(g["q"])


def test_arange_comparison_is_causal():
    verdict = _verdict([node("LessOrEqual", ["j", "i"], "keep")])
    assert (verdict.kind, verdict.window, verdict.alignment) == ("causal", 0, "square")


@pytest.mark.parametrize("upper, k, masked_when", [(0, 0, False), (1, 1, True)],
                         ids=["tril-keep", "triu1-masked"])
def test_trilu_of_ones_in_both_conventions(upper, k, masked_when):
    nodes = [node("Concat", ["s_1d", "t_1d"], "st", axis=0), const("true", True),
             node("Expand", ["true", "st"], "ones"), const("kk", k),
             node("Trilu", ["ones", "kk"], "keep", upper=upper)]
    assert _verdict(nodes, masked_when=masked_when).kind == "causal"


def test_window_is_measured():
    nodes = [node("LessOrEqual", ["j", "i"], "causal"), const("w", 3),
             node("Sub", ["i", "w"], "i_w"), node("Greater", ["j", "i_w"], "recent"),
             node("And", ["causal", "recent"], "keep")]
    verdict = _verdict(nodes)
    assert (verdict.kind, verdict.window) == ("causal", 3)


def test_a_window_longer_than_short_lengths_is_still_found():
    """A window of 40 looks causal at lengths below 40: the oracle evaluates beyond it."""
    nodes = [node("LessOrEqual", ["j", "i"], "causal"), const("w", 40),
             node("Sub", ["i", "w"], "i_w"), node("Greater", ["j", "i_w"], "recent"),
             node("And", ["causal", "recent"], "keep")]
    assert _verdict(nodes).window == 40


def test_alignment_with_two_lengths():
    top_left = _verdict([node("LessOrEqual", ["j", "i"], "keep")], CROSS)
    assert (top_left.kind, top_left.alignment) == ("causal", "top-left")
    shifted = [node("Sub", ["t", "s"], "off"), node("Add", ["i", "off"], "i_off"),
               node("LessOrEqual", ["j", "i_off"], "keep")]
    bottom_right = _verdict(shifted, CROSS)
    assert (bottom_right.kind, bottom_right.alignment) == ("causal", "bottom-right")


@pytest.mark.parametrize("nodes", [
    [node("Less", ["j", "i"], "past"), node("Not", ["past"], "keep")],  # inverted: masks the past
    [const("one_", 1), node("Add", ["i", "one_"], "i1"), node("LessOrEqual", ["j", "i1"], "keep")],
    [const("w", 3), node("Sub", ["i", "w"], "i_w"), node("Greater", ["j", "i_w"], "keep")],
    [node("LessOrEqual", ["j", "i"], "c"), const("n40", 40), node("GreaterOrEqual", ["i", "n40"], "late"),
     node("Or", ["c", "late"], "keep")],
], ids=["inverted", "diagonal-plus-one", "window-without-causal", "causal-only-below-40"])
def test_near_misses_are_never_causal(nodes):
    verdict = _verdict(nodes)
    assert verdict.kind == "other", verdict


def test_float_mask_and_position_bias():
    """0/-inf is a mask; finite values where keys are kept make it a position bias."""
    masked = [node("Greater", ["j", "i"], "future"), const("ninf", float("-inf")),
              const("zero_f", 0.0), node("Where", ["future", "ninf", "zero_f"], "keep")]
    oracle, g = _keep(masked)
    verdict = oracle.pattern([SizeLeaf(g["keep"], None)], SQUARE)
    assert verdict.kind == "causal" and not verdict.biases
    alibi = masked + [node("Sub", ["j", "i"], "dist"), node("Cast", ["dist"], "dist_f", to=1),
                      node("Add", ["keep", "dist_f"], "biased")]
    oracle, g = _keep(alibi, out="biased")
    verdict = oracle.pattern([SizeLeaf(g["biased"], None)], SQUARE)
    assert verdict.kind == "causal" and len(verdict.biases) == 1


def test_unrelated_score_dims_are_refused():
    oracle, g = _keep([node("LessOrEqual", ["j", "i"], "keep")])
    verdict = oracle.pattern([SizeLeaf(g["keep"], False)], ScoreDims("B", 2, "?", "S", 4))
    assert verdict.kind == "other" and "cannot be related" in verdict.reason


def test_dims_of_intermediates_cut_the_slice():
    """Shape of an intermediate with known dims is fed directly, so nothing before it runs
    (here an op of a domain no runtime knows)."""
    proto = model([helper.make_node("Mystery", ["q"], ["hidden"], domain="custom")]
                  + aranges("hidden", "hidden") + [node("LessOrEqual", ["j", "i"], "keep")],
                  qkv_inputs(), ["keep"])
    proto.graph.value_info.append(tensor("hidden", F, ["B", 2, "S", 8]))
    proto.opset_import.append(helper.make_opsetid("custom", 1))
    g = Graph(proto)
    assert Oracle(g.model).pattern([SizeLeaf(g["keep"], False)], SQUARE).kind == "causal"


def test_values_of_inputs_are_not_size_only():
    g = Graph(model([node("Not", ["m"], "keep")], [tensor("m", BOOL, ["B", "S"])], ["keep"]))
    assert not Oracle(g.model).size_only(g["keep"])


def test_an_alibi_table_sliced_to_the_keys_is_a_bias_within_its_length():
    """MPT: ALiBi as a [H, 1, 64] table sliced to the last T keys. Past 64 the slice no
    longer fits the scores (the model cannot run there either), so the oracle evaluates at
    the longest lengths within it; far keys get graded scores below -100 (not one fill):
    a bias added as it is, never a mask."""
    import numpy as np

    table = -(63 - np.arange(64, dtype=np.float32))[None, None, :] * np.array(
        [[[0.5]], [[4.0]]], np.float32)
    nodes = [const("table", table), const("n64", [64]), node("Sub", ["n64", "t_1d"], "start"),
             const("end", [64]), const("axis2", [2]),
             node("Slice", ["table", "start", "end", "axis2"], "keep")]
    oracle, g = _keep(nodes)
    verdict = oracle.pattern([SizeLeaf(g["keep"], None)], SQUARE)
    assert verdict.kind == "none" and [b.value for b in verdict.biases] == [g["keep"]]
