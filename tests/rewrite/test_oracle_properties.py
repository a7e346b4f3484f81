"""The oracle on random size-only masks (hypothesis): it never raises, whatever sizes a piece
can or cannot take, and what it calls causal is causal: the mask, evaluated at sizes it did
not try, is exactly the causal pattern of the verdict's alignment and window."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator

from mha_onnx.rewrite.recognise.masks import ScoreDims, SizeLeaf
from mha_onnx.rewrite.recognise.oracle import Oracle
from tests.irgraphs import Graph, aranges, const, model, node, qkv_inputs

CMP = ("LessOrEqual", "Less", "GreaterOrEqual", "Greater")


@st.composite
def _piece(draw, n: int) -> list:
    """One bool [S, T] piece named ``p{n}``: j compared with i (+ the key offset T - S) + a,
    a Trilu of ones, or j / i against a constant (a window, a length limit)."""
    a = draw(st.one_of(st.integers(-1, 1), st.integers(-6, 6)))
    kind = draw(st.sampled_from(["diag", "bottom", "diag", "bottom", "trilu", "const"]))
    out, c = f"p{n}", f"c{n}"
    if kind == "trilu":
        return [node("Concat", ["s_1d", "t_1d"], f"st{n}", axis=0), const(f"true{n}", True),
                node("Expand", [f"true{n}", f"st{n}"], f"ones{n}"), const(c, a),
                node("Trilu", [f"ones{n}", c], out, upper=draw(st.integers(0, 1)))]
    op = draw(st.sampled_from(CMP[:2] + CMP))  # keep-below comparisons twice as often
    if kind == "const":
        return [const(c, abs(a) + 1), node(op, [draw(st.sampled_from(["i", "j"])), c], out)]
    nodes = [const(c, a), node("Add", ["i", c], f"ia{n}")]
    if kind == "bottom":  # i + (T - S) + a
        nodes += [node("Sub", ["t", "s"], f"off{n}"), node("Add", [f"ia{n}", f"off{n}"],
                                                          f"ib{n}")]
    return nodes + [node(op, ["j", f"ib{n}" if kind == "bottom" else f"ia{n}"], out)]


@st.composite
def _mask(draw) -> list:
    """Up to three pieces combined with And / Or, possibly negated: ``keep`` [S, T]."""
    count = draw(st.integers(1, 3))
    nodes = [x for n in range(count) for x in draw(_piece(n))]
    current = "p0"
    for n in range(1, count):
        op = draw(st.sampled_from(["And", "Or"]))
        nodes.append(node(op, [current, f"p{n}"], f"m{n}"))
        current = f"m{n}"
    if draw(st.booleans()):
        nodes.append(node("Not", [current], "keep"))
    else:
        nodes.append(node("Identity", [current], "keep"))
    return nodes


def _show(nodes) -> str:
    """The mask expression, constants with their values, for a failure message."""
    out = []
    for n in nodes:
        if n.op_type == "Constant":
            out.append(f"{n.output[0]}={onnx.numpy_helper.to_array(n.attribute[0].t).tolist()}")
        else:
            out.append(f"{n.output[0]}={n.op_type}({','.join(n.input)})")
    return "; ".join(out)


def _expected(verdict, s: int, t: int) -> np.ndarray:
    """keep [S, T] of a causal verdict: key j <= the query's position (i, or i + T - S
    bottom-right), within the last ``window`` keys."""
    i, j = np.arange(s)[:, None], np.arange(t)[None, :]
    pos = i + (t - s) if verdict.alignment == "bottom-right" else i
    keep = j <= pos
    if verdict.window:
        keep &= j > pos - verdict.window
    return keep


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(nodes=_mask(), cross=st.booleans())
def test_random_size_only_masks_never_crash_and_causal_verdicts_hold(nodes, cross):
    seq_kv = "T" if cross else "S"
    proto = model(aranges() + nodes, qkv_inputs("S", seq_kv), ["keep"])
    graph = Graph(proto)
    sd = ScoreDims("B", 2, "S", seq_kv, 4)
    verdict = Oracle(graph.model).pattern([SizeLeaf(graph["keep"], False, fill=float("-inf"))],
                                          sd)  # never raises: a verdict or "other" with why
    assert verdict.kind in ("none", "causal", "other")
    assert verdict.kind != "other" or verdict.reason
    if verdict.kind != "causal":
        return
    evaluator = ReferenceEvaluator(proto)
    for s, t in ((3, 3), (6, 11), (40, 47), (70, 70)):  # sizes the oracle did not try
        if not cross:
            t = s
        elif verdict.alignment == "square":
            continue  # a square verdict is a claim for S == T only
        feeds = {name: np.zeros((1, 2, n, 8), np.float32)
                 for name, n in (("q", s), ("k", t), ("v", t))}
        (keep,) = evaluator.run(None, feeds)
        keep = np.broadcast_to(np.asarray(keep, bool), (s, t))
        np.testing.assert_array_equal(keep, _expected(verdict, s, t),
                                      err_msg=f"{verdict} at S={s}, T={t}: {_show(nodes)}")


def test_a_mask_that_masks_every_key_is_not_causal():
    """Found by the property: keep = (j <= i) and (j > i) masks everything; it was read as
    causal (a 'window' of no key looked like no window)."""
    nodes = [const("c0", 0), node("LessOrEqual", ["j", "i"], "p0"),
             node("Greater", ["j", "i"], "p1"), node("And", ["p0", "p1"], "keep")]
    graph = Graph(model(aranges() + nodes, qkv_inputs(), ["keep"]))
    verdict = Oracle(graph.model).pattern(
        [SizeLeaf(graph["keep"], False, fill=float("-inf"))], ScoreDims("B", 2, "S", "S", 4))
    assert verdict.kind == "other"


def test_the_strategy_builds_valid_graphs():
    """One fixed draw checks the graph builder itself (the property above runs as slow)."""
    nodes = [const("c0", 0), node("Add", ["i", "c0"], "ia0"), node("LessOrEqual", ["j", "ia0"],
                                                                   "p0"),
             node("Identity", ["p0"], "keep")]
    proto = model(aranges() + nodes, qkv_inputs(), ["keep"])
    feeds = {name: np.zeros((1, 2, 4, 8), np.float32) for name in ("q", "k", "v")}
    (keep,) = ReferenceEvaluator(proto).run(None, feeds)
    np.testing.assert_array_equal(np.asarray(keep, bool).reshape(4, 4), np.tri(4, dtype=bool))
    graph = Graph(proto)
    verdict = Oracle(graph.model).pattern(
        [SizeLeaf(graph["keep"], False, fill=float("-inf"))], ScoreDims("B", 2, "S", "S", 4))
    assert (verdict.kind, verdict.window) == ("causal", 0)
