"""Taking mask terms apart (masks.py) and reducing them to a meaning (meaning.py): boolean
trees, float spellings of booleans, key padding leaves, and what must stay a dense bias."""

from __future__ import annotations

import math

import pytest

from mha_onnx.rewrite.recognise.masks import Padding, ScoreDims, Term, take_apart
from mha_onnx.rewrite.recognise.meaning import Unsupported, plan
from mha_onnx.rewrite.recognise.oracle import Oracle
from tests.irgraphs import BOOL, F, Graph, aranges, const, model, node, qkv_inputs, tensor

SD = ScoreDims("B", 2, "S", "S", 4)
B64 = 7  # TensorProto.INT64


def _pad_inputs() -> list:
    return qkv_inputs() + [tensor("pad", BOOL, ["B", "S"]), tensor("am", B64, ["B", "S"])]


def _padding_b11t(source: str, out: str) -> list:
    """[B, S] -> [B, 1, 1, S] (Unsqueeze), the usual broadcast of key padding."""
    return [const(out + "_axes", [1, 2]), node("Unsqueeze", [source, out + "_axes"], out)]


def _graph(nodes: list, outs: list[str]) -> Graph:
    return Graph(model(aranges() + nodes, _pad_inputs(), outs))


def _size_only(g: Graph):
    return Oracle(g.model).size_only


def test_and_of_keeps_is_a_union_of_masked_keys():
    g = _graph([node("LessOrEqual", ["j", "i"], "causal"), *_padding_b11t("pad", "pad4"),
                node("Not", ["pad4"], "kept"), node("And", ["causal", "kept"], "keep")], ["keep"])
    pieces = take_apart([Term("replace", g["keep"], 1.0, -math.inf, False)], SD, _size_only(g))
    assert not pieces.reason and len(pieces.size) == 1 and pieces.size[0].value is g["causal"]
    (padding, fill), = pieces.padding
    assert padding == Padding(g["pad"], inverted=False) and fill == -math.inf


def test_hugging_face_float_spelling_of_a_keep_mask():
    """(1 - attention_mask) * finfo.min, attention_mask int 1 = keep."""
    g = _graph([*_padding_b11t("am", "am4"), node("Cast", ["am4"], "amf", to=F), const("one_f", 1.0),
                node("Sub", ["one_f", "amf"], "inv"), const("low", -3.4e38),
                node("Mul", ["inv", "low"], "bias")], ["bias"])
    pieces = take_apart([Term("add", g["bias"], 1.0)], SD, _size_only(g))
    (padding, fill), = pieces.padding
    assert padding.source is g["am"] and padding.inverted and fill == pytest.approx(-3.4e38)


def test_cast_times_fill_and_where_spellings():
    g = _graph([*_padding_b11t("pad", "p4"), node("Cast", ["p4"], "pf", to=F), const("big", -1e9),
                node("Mul", ["pf", "big"], "mul_bias"), const("z", 0.0), const("ninf", -math.inf),
                node("Where", ["p4", "ninf", "z"], "where_bias")], ["mul_bias", "where_bias"])
    for name in ("mul_bias", "where_bias"):
        pieces = take_apart([Term("add", g[name], 1.0)], SD, _size_only(g))
        assert [p for p, _ in pieces.padding] == [Padding(g["pad"], False)], name


def test_intersection_of_masked_sets_is_not_understood():
    """And over *masked* flags masks keys only where both do: no kernel form for that."""
    g = _graph([*_padding_b11t("pad", "p4"), node("LessOrEqual", ["j", "i"], "c"),
                node("Not", ["c"], "future"), node("And", ["future", "p4"], "masked")], ["masked"])
    pieces = take_apart([Term("replace", g["masked"], 1.0, -math.inf, True)], SD, _size_only(g))
    assert pieces.reason


def test_a_data_mask_over_queries_is_not_key_padding():
    g = Graph(model([node("Not", ["m"], "keep")],
                    qkv_inputs() + [tensor("m", BOOL, ["B", 1, "S", "S"])], ["keep"]))
    pieces = take_apart([Term("replace", g["keep"], 1.0, -math.inf, False)], SD, _size_only(g))
    assert "not a [B, T] key padding" in pieces.reason


def test_a_mask_input_shaped_to_broadcast_is_key_padding():
    """A seq2seq export that takes its mask as [B, 1, T] (or [B, 1, 1, T]) and masks with
    ``Where(mask == 0, -1e9, scores)``: key padding, not a dense bias; [B, S, T] is not."""
    for shape, padding in ((["B", 1, "S"], True), (["B", 1, 1, "S"], True),
                           (["B", "S", "S"], False)):
        axes = [1] if len(shape) == 3 else []
        nodes = ([const("ax", axes), node("Unsqueeze", ["m", "ax"], "m4")] if axes else
                 [node("Identity", ["m"], "m4")])
        nodes += [const("zero", 0), node("Equal", ["m4", "zero"], "masked")]
        g = Graph(model(nodes, qkv_inputs() + [tensor("m", B64, shape)], ["masked"]))
        pieces = take_apart([Term("replace", g["masked"], 1.0, -1e9, True)], SD, _size_only(g))
        if padding:
            assert not pieces.reason, (shape, pieces.reason)
            assert [p for p, _ in pieces.padding] == [Padding(g["m"], inverted=True)], shape
        else:
            assert "not a [B, T] key padding" in pieces.reason, shape


def test_a_float_bias_on_merged_heads_is_kept_as_a_bias():
    """BLOOM's ALiBi: slopes x positions computed from the padding mask, added to [B*H, 1, T]
    scores; a bias added as it is, whatever its values."""
    g = _graph([node("Cast", ["am"], "amf", to=F), const("cs_axis", 1),
                node("CumSum", ["amf", "cs_axis"], "pos"), const("slopes", [[0.5], [0.25]]),
                node("Mul", ["slopes", "pos"], "alibi")], ["alibi"])
    term = Term("add", g["alibi"], 1.0, lift=2)
    pieces = take_apart([term], SD, _size_only(g))
    assert not pieces.reason and pieces.merged[0].value is g["alibi"]
    assert pieces.merged[0].lift == 2 and not pieces.size and not pieces.padding


def test_a_masked_fill_on_merged_heads_stays_dense():
    """A boolean mask spelled on [B*H, S, T] (Where(pad, -inf, 0), masked_fill): a mask, not
    a bias; kept in the dense form, never passed as a bias."""
    g = _graph([*_padding_b11t("pad", "p4"), const("z", 0.0), const("ninf", -math.inf),
                node("Where", ["p4", "ninf", "z"], "where_bias")], ["where_bias", "p4"])
    for term in (Term("add", g["where_bias"], 1.0, lift=2),
                 Term("replace", g["p4"], 1.0, -math.inf, True, lift=2)):
        pieces = take_apart([term], SD, _size_only(g))
        assert not pieces.merged and "batch and heads merged" in pieces.reason


# -- meaning ---------------------------------------------------------------------------------

def _meaning(nodes: list, out: str, term_of):
    g = _graph(nodes, [out])
    return plan([term_of(g[out])], SD, Oracle(g.model)), g


def test_causal_plus_padding():
    meaning, g = _meaning(
        [node("LessOrEqual", ["j", "i"], "causal"), *_padding_b11t("pad", "p4"),
         node("Not", ["p4"], "kept"), node("And", ["causal", "kept"], "keep")], "keep",
        lambda v: Term("replace", v, 1.0, -math.inf, False))
    assert meaning.causal is not None and meaning.padding is not None
    assert meaning.describe() == "causal + key padding" and meaning.kind == "causal"


def test_causal_plus_a_merged_bias_is_causal_with_the_bias_added():
    g = _graph([node("LessOrEqual", ["j", "i"], "keep"), node("Cast", ["am"], "amf", to=F),
                const("slopes", [[0.5], [0.25]]), node("Mul", ["slopes", "amf"], "alibi")],
               ["keep", "alibi"])
    meaning = plan([Term("add", g["alibi"], 1.0, lift=2),
                    Term("replace", g["keep"], 1.0, -math.inf, False)], SD, Oracle(g.model))
    assert meaning.kind == "causal" and meaning.causal is not None and not meaning.reason
    assert meaning.added == meaning.merged and meaning.merged[0].value is g["alibi"]
    assert meaning.describe() == "causal + bias on merged heads (ALiBi-style)"


def test_a_size_only_bias_that_masks_nothing_is_a_position_bias():
    """-5 above the diagonal does not remove keys: a position bias, never causal."""
    meaning, _ = _meaning([node("Greater", ["j", "i"], "future"), node("Cast", ["future"], "ff", to=F),
                           const("small", -5.0), node("Mul", ["ff", "small"], "bias")], "bias",
                          lambda v: Term("add", v, 1.0))
    assert meaning.causal is None and meaning.biases and meaning.describe() == "position bias"


def test_a_padding_fill_that_does_not_remove_keys_is_a_dense_bias():
    meaning, _ = _meaning([*_padding_b11t("pad", "p4"), const("small", -5.0), const("z", 0.0),
                           node("Where", ["p4", "small", "z"], "bias")], "bias",
                          lambda v: Term("add", v, 1.0))
    assert meaning.kind == "bias" and "does not remove" in meaning.reason


def test_two_different_paddings_stay_dense():
    g = _graph([*_padding_b11t("pad", "p4"), *_padding_b11t("am", "a4"), node("Cast", ["a4"], "ab", to=BOOL),
                node("Or", ["p4", "ab"], "masked")], ["masked"])
    meaning = plan([Term("replace", g["masked"], 1.0, -math.inf, True)], SD, Oracle(g.model))
    assert meaning.kind == "bias" and "two different key paddings" in meaning.reason


def test_finite_masked_fill_combined_with_other_masks_is_refused():
    g = _graph([*_padding_b11t("pad", "p4"), node("LessOrEqual", ["j", "i"], "c"), node("Not", ["c"], "future")],
               ["p4", "future"])
    terms = [Term("replace", g["p4"], 1.0, -5.0, True), Term("replace", g["future"], 1.0, -math.inf, True)]
    with pytest.raises(Unsupported, match="finite value -5"):
        plan(terms, SD, Oracle(g.model))


def test_padding_is_proven_by_evaluation():
    """The oracle checks a claimed padding against the mask's values: the true claim holds,
    the opposite polarity or another source does not."""
    g = _graph([*_padding_b11t("pad", "p4"), node("LessOrEqual", ["j", "i"], "c"),
                node("Not", ["p4"], "kept"), node("And", ["c", "kept"], "keep")], ["keep"])
    oracle = Oracle(g.model)
    terms = [Term("replace", g["keep"], 1.0, -math.inf, False)]
    pieces = take_apart(terms, SD, oracle.size_only)
    assert oracle.padding_agrees(terms, pieces.size, Padding(g["pad"], False), SD) == ""
    wrong = oracle.padding_agrees(terms, pieces.size, Padding(g["pad"], True), SD)
    assert "checked by evaluation" in wrong
    no_causal = oracle.padding_agrees(terms, (), Padding(g["pad"], False), SD)
    assert "checked by evaluation" in no_causal


def test_a_float_mask_cast_to_bool_is_read_through_its_spelling():
    """MPT: masked_fill(Cast(Where(keep, 0, min), bool), min): True (masked) where keep is
    False: the causal keep and the padding inside are found."""
    g = _graph([node("LessOrEqual", ["j", "i"], "causal"), *_padding_b11t("am", "am4"),
                node("Cast", ["am4"], "amb", to=BOOL), node("And", ["causal", "amb"], "keep"),
                const("zf", 0.0), const("low", -3.4e38), node("Where", ["keep", "zf", "low"], "fm"),
                node("Cast", ["fm"], "masked", to=BOOL)], ["masked"])
    pieces = take_apart([Term("replace", g["masked"], 1.0, -3.4e38, True)], SD, _size_only(g))
    assert not pieces.reason and [leaf.value for leaf in pieces.size] == [g["causal"]]
    (padding, _), = pieces.padding
    assert padding.source is g["am"] and padding.inverted


def test_a_b1t_mask_input_fuses_as_key_padding_with_its_fully_masked_rows():
    """End to end: q [B, 4, S, 8], k/v [B, 4, T, 8], mask [B, 1, T] (1 = keep) through
    ``Where(mask == 0, -1e9, scores)``; fused as key padding and verified, fully masked rows
    (every key -1e9: the mean of V) included."""
    import numpy as np
    from onnx import TensorProto, helper

    from mha_onnx.rewrite.check.verify import verify
    from mha_onnx.rewrite.fuse import fuse_model
    from mha_onnx.runtime.ort import OrtRunner

    f, i = TensorProto.FLOAT, TensorProto.INT64
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Mul", ["qk", "scale"], ["scores"]),
             helper.make_node("Equal", ["mask", "zero"], ["masked3"]),
             helper.make_node("Unsqueeze", ["masked3", "one"], ["masked"]),
             helper.make_node("Where", ["masked", "fill", "scores"], ["filled"]),
             helper.make_node("Softmax", ["filled"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["probs", "v"], ["out"])]
    inits = [helper.make_tensor("one", i, [1], [1]), helper.make_tensor("zero", i, [], [0]),
             helper.make_tensor("fill", f, [], [-1e9]),
             helper.make_tensor("scale", f, [], [8 ** -0.5])]
    ins = [helper.make_tensor_value_info("q", f, ["B", 4, "S", 8]),
           helper.make_tensor_value_info("k", f, ["B", 4, "T", 8]),
           helper.make_tensor_value_info("v", f, ["B", 4, "T", 8]),
           helper.make_tensor_value_info("mask", i, ["B", 1, "T"])]
    original = helper.make_model(
        helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info(
            "out", f, ["B", 4, "S", 8])], inits),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    fused, blocks, _ = fuse_model(original)
    assert [b.status for b in blocks] == ["fused"], [b.reason for b in blocks]
    assert blocks[0].mask == "key_padding", blocks[0].meaning
    assert verify(original, fused).passed
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32)
             for n, s in (("q", (2, 4, 3, 8)), ("k", (2, 4, 5, 8)), ("v", (2, 4, 5, 8)))}
    feeds["mask"] = np.array([[[1, 1, 1, 0, 0]], [[0, 0, 0, 0, 0]]], np.int64)
    want = OrtRunner(original.SerializeToString()).infer(feeds)["out"]
    got = OrtRunner(fused.SerializeToString()).infer(feeds)["out"]
    np.testing.assert_allclose(got, want, atol=1e-5)  # row 1: every key masked
    np.testing.assert_allclose(want[1], np.broadcast_to(feeds["v"][1].mean(1, keepdims=True),
                                                        want[1].shape), atol=1e-5)
