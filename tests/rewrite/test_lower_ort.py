"""lower_ort (with lower_loop's Loop form): one Sdpa node onto ONNX Runtime's
MultiHeadAttention forms, each checked for its kernel, parity with attention in numpy and
what a query whose keys are all padded gets (the original's NaN or mean of V)."""

from __future__ import annotations

import numpy as np
import pytest

from mha_onnx.rewrite.blocks import find_blocks
from mha_onnx.rewrite.policy import FormPolicy
from tests.sdpa_graphs import (
    Meaning,
    assert_matches,
    feeds,
    lower_for_ort,
    ops,
    reference,
    run,
    sdpa_model,
)

MIN32 = float(np.finfo(np.float32).min)


def _padding(batch: int, t: int) -> np.ndarray:
    """Row 0 unpadded, 1 right-padded, 2 left-padded, 3 every key padded."""
    padded = np.zeros((batch, t), bool)
    padded[1, t - 2:] = True
    padded[2, :3] = True
    padded[3, :] = True
    return padded


def _check(meaning: Meaning, forms: FormPolicy, s: int, t: int, padded=None):
    model = sdpa_model(meaning)
    chosen = lower_for_ort(model, forms).forms
    f = feeds(meaning, 4, s, t, padded)
    assert_matches(run(model, f), reference(meaning, f))
    return model, chosen["block0"]


def test_no_mask_is_one_multihead_attention():
    model, form = _check(Meaning(), FormPolicy(), 5, 7)
    assert form.kernel == "MultiHeadAttention" and not form.guard
    assert "MultiHeadAttention" in ops(model) and "If" not in ops(model)


@pytest.mark.parametrize("fill", [-np.inf, MIN32], ids=["nan-rows", "mean-rows"])
@pytest.mark.parametrize("form, kernel", [
    ("mask", "MultiHeadAttention"), ("bias", "MultiHeadAttention"), ("loop", "Loop"),
    ("gqa", "GroupQueryAttention")])
def test_each_key_padding_form(form, kernel, fill):
    """Every row pattern in one batch (the GQA form's check sends it to its other branch);
    a fully padded row gets NaN (-inf fill) or the mean of V (the lowest float)."""
    meaning = Meaning(padded=True, fill=fill)
    model, chosen = _check(meaning, FormPolicy(key_padding=form), 3, 8, _padding(4, 8))
    assert kernel in ops(model)
    assert (chosen.guard == "right padding") == (form == "gqa")


def test_key_padding_gqa_branch_when_every_row_is_right_padded():
    meaning = Meaning(padded=True)
    padded = np.zeros((4, 8), bool)
    padded[1, 5:] = True
    model, chosen = _check(meaning, FormPolicy(key_padding="gqa"), 8, 8, padded)
    assert chosen.kernel == "GroupQueryAttention (bidirectional)"


@pytest.mark.parametrize("t", [8, 200], ids=["short-mha-mask", "long-loop"])
def test_auto_switches_by_length_and_padding(t):
    """auto: GQA when right-padded (T <= 1024), else MHA key_padding_mask below 128 keys
    and the Loop from there; every branch computes the same numbers."""
    model, chosen = _check(Meaning(padded=True), FormPolicy(), 4, t, _padding(4, t))
    assert {"GroupQueryAttention", "MultiHeadAttention", "Loop", "If"} <= ops(model)
    assert chosen.switch_at and chosen.otherwise is not None
    if t == 200:  # inspect's op column: one label however deep the Ifs nest
        (block,) = find_blocks(model.graph)
        assert block.op == ("If[com.microsoft.GroupQueryAttention, "
                            "com.microsoft.MultiHeadAttention] (4 levels)"), block.op


def test_grouped_kv_heads_are_repeated_for_mha():
    meaning = Meaning(padded=True, kv_heads=2)
    model, _ = _check(meaning, FormPolicy(key_padding="mask"), 3, 6, _padding(4, 6))
    assert "MultiHeadAttention" in ops(model)


@pytest.mark.parametrize("form, label", [("unidirectional", "unidirectional"),
                                         ("bias", "causal bias")])
def test_causal_without_gqa(form, label):
    model, chosen = _check(Meaning(causal=True), FormPolicy(causal=form), 6, 6)
    assert label in chosen.kernel and "GroupQueryAttention" not in ops(model)


def test_the_dense_general_form_for_a_window_off_gqa():
    """A sliding window that GQA may not take (forms say no GQA): the mask as a bias."""
    meaning = Meaning(causal=True, window=3)
    model, chosen = _check(meaning, FormPolicy(causal="bias"), 6, 6)
    assert chosen.kernel == "MultiHeadAttention + attention_bias"


def test_a_form_switching_on_computed_keys_says_how_they_are_computed():
    """Keys that are an expression of input dims (a speech encoder's frames): the form
    carries it, so verification can run the input lengths that cross each switch."""
    model = sdpa_model(Meaning(padded=True), keys="samples // 10 - 1")
    form = lower_for_ort(model, FormPolicy()).forms["block0"]
    assert form.switches() and form.keys == "samples // 10 - 1"
    plain = lower_for_ort(sdpa_model(Meaning(padded=True)), FormPolicy()).forms["block0"]
    assert plain.keys == ""  # keys that are an input dim need nothing more
