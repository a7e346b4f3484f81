"""lower_cache: a causal layer with an appended KV cache (keys = Concat(past, new), also the
presents) onto ORT's attention with past for a decode step, GQA for the prompt and the
original mask for chunks after a past; the rule that matched the appended caches returns
the kernel's presents in place of the Concats. Checked for each run the If can take: outputs and presents against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from mha_onnx.rewrite.policy import FormPolicy
from tests.sdpa_graphs import (
    Meaning,
    assert_matches,
    cached_feeds,
    cached_model,
    lower_for_ort,
    ops,
    reference,
    run_all,
)

RUNS = {"prompt": (0, 5), "decode step": (6, 1), "chunk after a past": (4, 3)}


def _lowered(meaning: Meaning):
    model = cached_model(meaning)
    stage = lower_for_ort(model, FormPolicy())
    return model, stage.forms["block0"], stage.pairs(model.graph)


def _check(model, meaning: Meaning, past: int, s: int, padded=None) -> None:
    f = cached_feeds(meaning, 3, past, s, padded)
    got = run_all(model, f)
    assert_matches(got["out"], reference(meaning, f))
    for name in ("k", "v"):  # the presents: the past with the new positions appended
        np.testing.assert_array_equal(got[f"present_{name}"], f[name])


@pytest.mark.parametrize("kv_heads, kernel", [(4, "MultiHeadAttention"),
                                              (2, "GroupQueryAttention")])
def test_a_step_runs_on_the_kernels_own_past(kv_heads, kernel):
    meaning = Meaning(causal=True, alignment="bottom-right", kv_heads=kv_heads)
    model, form, pairs = _lowered(meaning)
    assert form.kernel == f"{kernel} with past (presents from it)"
    assert pairs == {"past_k": "present_k", "past_v": "present_v"}
    present = next(o for o in model.graph.outputs if o.name == "present_k")
    assert present.producer().op_type == "If"  # no Concat copies the cache outside it
    for past, s in RUNS.values():
        _check(model, meaning, past, s)


def test_grouped_kv_with_key_padding_steps_on_gqa_with_a_padding_bias():
    meaning = Meaning(causal=True, alignment="bottom-right", kv_heads=2, padded=True)
    model, form, _ = _lowered(meaning)
    assert form.kernel.startswith("GroupQueryAttention with past + padding bias")
    assert "GroupQueryAttention" in ops(model)
    for past, s in RUNS.values():
        padded = np.zeros((3, past + s), bool)
        padded[1, :2] = True  # a left-padded row (its first queries see no key: NaN)
        _check(model, meaning, past, s, padded)


def test_a_window_is_kept_on_every_run():
    meaning = Meaning(causal=True, alignment="bottom-right", kv_heads=2, window=3)
    model, form, _ = _lowered(meaning)
    assert "GroupQueryAttention" in form.kernel
    for past, s in RUNS.values():
        _check(model, meaning, past, s)


@pytest.mark.parametrize("kv_heads, kernel", [(4, "MultiHeadAttention with past + attention_bias"),
                                              (2, "GroupQueryAttention with past")])
def test_a_position_bias_is_added_by_every_form(kv_heads, kernel):
    """ALiBi or T5's relative bias on a cached layer: the step adds it on the kernel with
    past, the prompt on GQA's attention_bias, a chunk with the dense mask."""
    meaning = Meaning(causal=True, alignment="bottom-right", kv_heads=kv_heads, bias=True,
                      padded=kv_heads == 2)
    model, form, pairs = _lowered(meaning)
    assert form.kernel.startswith(kernel) and "(presents from it)" in form.kernel
    assert pairs == {"past_k": "present_k", "past_v": "present_v"}
    for past, s in RUNS.values():
        padded = np.zeros((3, past + s), bool)
        padded[2, past + s - 1:] = s > 1  # a right-padded row where there are new tokens
        _check(model, meaning, past, s, padded if meaning.padded else None)


@pytest.mark.parametrize("kv_heads, padded", [(4, False), (2, False), (2, True)])
def test_soft_capping_is_kept_on_every_run(kv_heads, padded):
    """Gemma 2's capped scores with a cache: the step and the prompt on GQA's ``softcap``, a
    chunk after a past (and a padded batch) on the capped general form; a cap of 1 binds."""
    meaning = Meaning(causal=True, alignment="bottom-right", kv_heads=kv_heads,
                      softcap=1.0, padded=padded)
    model, form, _ = _lowered(meaning)
    assert "GroupQueryAttention with past" in form.kernel and "softcap 1" in form.kernel
    for past, s in RUNS.values():
        rows = np.zeros((3, past + s), bool)
        rows[1, :2] = True  # a left-padded row
        _check(model, meaning, past, s, rows if padded else None)
