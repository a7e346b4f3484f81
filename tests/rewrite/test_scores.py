"""The recognisers of scores.py: probabilities tail, score chain (scale, soft-cap, masks),
K's form and grouped K/V, each on graphs built with onnx.helper, near misses included."""

from __future__ import annotations

import numpy as np
import pytest

from mha_onnx.rewrite.recognise.keys import broadcast_heads, key_from_transposed, repeated_heads
from mha_onnx.rewrite.recognise.scores import Reject, probs_tail, score_chain
from tests.irgraphs import F, Graph, const, model, node, qkv_inputs, tensor


def _attention(between: list, scores_in: str = "qk", tail: list | None = None,
               inputs: list | None = None, outputs: tuple = ("out",)) -> Graph:
    """q·k^T -> ``between`` (ending in "scores") -> Softmax -> ``tail`` -> MatMul with v."""
    tail = tail if tail is not None else [node("Identity", ["p"], "p2")]
    last = tail[-1].output[0] if tail else "p"
    nodes = [node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]),
             node("MatMul", ["q", "kt"], "qk"), *between,
             node("Softmax", ["scores" if between else scores_in], "p", axis=-1), *tail,
             node("MatMul", [last, "v"], "out")]
    return Graph(model(nodes, inputs or qkv_inputs(), list(outputs)))


def test_probs_tail_through_a_nan_guard_and_casts():
    tail = [node("IsNaN", ["p"], "nan"), const("zero", 0.0), node("Where", ["nan", "zero", "p"], "g"),
            node("Cast", ["g"], "g2", to=F)]
    g = _attention([], tail=tail)
    found = probs_tail(g.node("out"))
    assert found.softmax is g.node("p") and found.nan_to_zero and len(found.nodes) == 5


def test_probs_used_elsewhere_are_refused():
    g = _attention([], tail=[], outputs=("out", "p"))
    with pytest.raises(Reject, match="also used elsewhere"):
        probs_tail(g.node("out"))


def test_not_a_softmax_is_not_a_candidate():
    g = Graph(model([node("MatMul", ["q", "v"], "out")], qkv_inputs(), ["out"]))
    with pytest.raises(Reject) as info:
        probs_tail(g.node("out"))
    assert not info.value.candidate


@pytest.mark.parametrize("spelling, scale", [
    ([const("c", 0.5), node("Mul", ["qk", "c"], "scores")], 0.5),
    ([const("c", 4.0), node("Div", ["qk", "c"], "scores")], 0.25),
    ([const("c", 2.0), node("Div", ["qk", "c"], "d"), const("c2", 0.5), node("Mul", ["c2", "d"], "scores")], 0.25),
], ids=["mul", "div", "div-then-mul"])
def test_scale_spellings(spelling, scale):
    chain = score_chain(_attention(spelling).node("p"), "b")
    assert chain.scale == pytest.approx(scale) and not chain.terms and chain.softcap == 0


def test_softcap_with_the_scale_inside_and_a_mask_after():
    between = [const("sc", 0.125), node("Mul", ["qk", "sc"], "s1"), const("cap", 50.0),
               node("Div", ["s1", "cap"], "s2"), node("Tanh", ["s2"], "s3"),
               node("Mul", ["s3", "cap"], "s4"), node("Add", ["s4", "m"], "scores")]
    g = _attention(between, inputs=qkv_inputs() + [tensor("m", F, [1, 1, "S", "S"])])
    chain = score_chain(g.node("p"), "b")
    assert chain.softcap == 50.0 and chain.scale == pytest.approx(0.125)
    assert [t.value.name for t in chain.terms] == ["m"]


@pytest.mark.parametrize("between, reason", [
    ([node("Tanh", ["qk"], "scores")], "not a soft-cap"),
    ([const("cap", 50.0), node("Div", ["qk", "cap"], "s2"), node("Tanh", ["s2"], "s3"),
      node("Mul", ["s3", "cap"], "s4"), const("two", 2.0), node("Mul", ["s4", "two"], "scores")],
     "scaled again after the cap"),
    ([node("Add", ["qk", "m"], "s1"), const("cap", 50.0), node("Div", ["s1", "cap"], "s2"),
      node("Tanh", ["s2"], "s3"), node("Mul", ["s3", "cap"], "scores")], "inside the soft-cap"),
    ([node("Relu", ["qk"], "scores")], "Relu between"),
    ([node("Mul", ["qk", "m"], "scores")], "non-constant"),
], ids=["bare-tanh", "scaled-after-cap", "mask-inside-cap", "relu", "dynamic-scale"])
def test_score_chains_that_are_refused(between, reason):
    g = _attention(between, inputs=qkv_inputs() + [tensor("m", F, [1, 1, "S", "S"])])
    with pytest.raises(Reject, match=reason):
        score_chain(g.node("p"), "b")


def test_masks_are_collected_with_the_scale_after_them():
    between = [node("Add", ["qk", "m"], "s1"), const("c", 0.5), node("Mul", ["s1", "c"], "scores")]
    g = _attention(between, inputs=qkv_inputs() + [tensor("m", F, [1, 1, "S", "S"])])
    chain = score_chain(g.node("p"), "b")
    (term,) = chain.terms
    assert term.mode == "add" and term.post == 0.5 and chain.scale == 0.5


@pytest.mark.parametrize("perm, form", [([0, 1, 3, 2], "bhtd"), ([0, 2, 3, 1], "bthd")])
def test_key_forms(perm, form):
    g = Graph(model([node("Transpose", ["k"], "kt", perm=perm)],
                    [tensor("k", F, ["B", 2, "T", 8])], ["kt"]))
    key, found = key_from_transposed(g["kt"], 4)
    assert found == form and key is g["k"]


def _repeat(groups: int, rep: int, axis: int = 2) -> Graph:
    nodes = [const("ax", [axis]), node("Unsqueeze", ["k", "ax"], "k5"),
             node("Shape", ["k"], "ks", start=0, end=1), node("Shape", ["k"], "kt", start=2, end=4),
             const("gr", [groups, rep]), node("Concat", ["ks", "gr", "kt"], "s5", axis=0),
             node("Expand", ["k5", "s5"], "wide"), const("h", [groups * rep]),
             node("Concat", ["ks", "h", "kt"], "s4", axis=0), node("Reshape", ["wide", "s4"], "k4")]
    return Graph(model(nodes, [tensor("k", F, ["B", groups, "T", 8])], ["k4"]))


def test_repeated_heads_are_grouped():
    g = _repeat(2, 4)
    found = repeated_heads(g["k4"], 8)
    assert found is not None and found.kv_heads == 2 and found.source is g["k"]
    assert repeated_heads(g["k4"], 4) is None  # the heads do not add up


def test_a_repeat_on_another_axis_is_not_grouping():
    assert repeated_heads(_repeat(2, 4, axis=1)["k4"], 8) is None


def test_one_head_broadcast_by_the_matmul_is_multi_query():
    g = Graph(model([node("Identity", ["k"], "k1")], [tensor("k", F, ["B", 1, "T", 8])], ["k1"]))
    assert broadcast_heads(g["k1"], 4).kv_heads == 1
    assert broadcast_heads(g["k1"], 1) is None


def test_a_scale_per_head_is_read_outside_the_masks_only():
    """Swin-v2: Softmax(Q·K^T * c[H, 1, 1] + bias): the factors per head are kept (and
    folded into Q later); a mask inside them (scaled per head too) or a scalar-shaped
    [H]-vector on the wrong axis is refused."""
    scale = [[[0.5]], [[2.0]]]
    g = _attention([const("c", scale), node("Mul", ["qk", "c"], "scaled"),
                    const("b", [[[[1.0]]]]), node("Add", ["scaled", "b"], "scores")])
    chain = score_chain(g.node("p"), "b")
    assert list(chain.head_scale) == [0.5, 2.0] and chain.scale == 1.0 and len(chain.terms) == 1
    inside = _attention([const("b", [[[[1.0]]]]), node("Add", ["qk", "b"], "biased"),
                         const("c", scale), node("Mul", ["biased", "c"], "scores")])
    with pytest.raises(Reject, match="mask inside a scale per head"):
        score_chain(inside.node("p"), "b")
    wrong_axis = _attention([const("c", [[0.5, 2.0]]), node("Mul", ["qk", "c"], "scores")])
    with pytest.raises(Reject, match="non-constant or zero"):
        score_chain(wrong_axis.node("p"), "b")


def test_a_clamp_of_the_masked_scores_is_read_and_a_higher_max_is_not():
    """XGLM's ``max(scores + mask, finfo.min)`` lifts only masked scores; a Max at -10 would
    change kept ones."""
    low = float(np.finfo(np.float32).min)
    for bound, reads in ((low, True), (-10.0, False)):
        between = [node("Add", ["qk", "m"], "s1"), const("lo", bound),
                   node("Max", ["s1", "lo"], "scores")]
        g = _attention(between, inputs=qkv_inputs() + [tensor("m", F, [1, 1, "S", "S"])])
        if reads:
            chain = score_chain(g.node("p"), "b")
            assert chain.floor == low and len(chain.terms) == 1
        else:
            with pytest.raises(Reject, match="not a clamp"):
                score_chain(g.node("p"), "b")
    scaled = [node("Add", ["qk", "m"], "s1"), const("lo", low), node("Max", ["s1", "lo"], "s2"),
              const("c", 0.5), node("Mul", ["s2", "c"], "scores")]  # the floor scaled after
    g = _attention(scaled, inputs=qkv_inputs() + [tensor("m", F, [1, 1, "S", "S"])])
    with pytest.raises(Reject, match="before a scale"):
        score_chain(g.node("p"), "b")
