"""lower_shared (``--kv-cache shared`` with one length for every row): a cached layer onto
GroupQueryAttention over a max-length buffer that is its past and its present, the
interface rewritten (share_interface: buffers, a ``past_sequence_length`` input). Checked
on each run the If takes: outputs against numpy, the buffer's first past + new positions,
and that nothing past them is read (filled with values that would show)."""

from __future__ import annotations

import numpy as np
import pytest

from mha_onnx.graph.cache import LENGTH_INPUT
from mha_onnx.rewrite.lower.shared import share_interface
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

MAX = 16
MIN32 = float(np.finfo(np.float32).min)


def _shared(meaning: Meaning):
    model = cached_model(meaning)
    stage = lower_for_ort(model, FormPolicy(kv_cache="shared"))
    assert share_interface(model.graph, stage.layers) == 1
    return model, stage.forms["block0"]


def _check(model, meaning: Meaning, past: int, s: int) -> None:
    f = cached_feeds(meaning, 3, past, s)
    for name in ("k", "v"):  # the buffers: the past first, then values nothing may read
        buffer = np.full((3, meaning.kv_heads, MAX, meaning.head), 1e4, meaning.np_dtype)
        buffer[:, :, :past] = f[f"past_{name}"]
        f[f"past_{name}"] = buffer
    f[LENGTH_INPUT] = np.array(past, np.int64)
    got = run_all(model, f)
    assert_matches(got["out"], reference(meaning, f))
    for name in ("k", "v"):
        assert got[f"present_{name}"].shape == (3, meaning.kv_heads, MAX, meaning.head)
        np.testing.assert_array_equal(got[f"present_{name}"][:, :, :past + s], f[name])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_steps_and_prompts_run_gqa_on_the_buffer_and_chunks_the_general_form(kv_heads):
    meaning = Meaning(causal=True, alignment="bottom-right", kv_heads=kv_heads)
    model, form = _shared(meaning)
    assert form.kernel == "GroupQueryAttention on a shared cache buffer"
    assert form.otherwise is not None and "GroupQueryAttention" in ops(model)
    inputs = [v.name for v in model.graph.inputs]
    assert LENGTH_INPUT in inputs
    past_k = next(v for v in model.graph.inputs if v.name == "past_k")
    assert str(past_k.shape[2]) == "max_sequence_length"
    for past, s in ((0, 5), (6, 1), (4, 3)):  # prompt, decode step (GQA), chunk (general)
        _check(model, meaning, past, s)


@pytest.mark.parametrize("mask_terms, fill", [(1, MIN32), (2, MIN32), (1, -1e4)],
                         ids=["one-term", "two-terms", "finite-fill"])
def test_left_padded_queries_of_a_prompt_get_what_the_masks_add_up_to(mask_terms, fill):
    """Per-row lengths (a padding input): a prompt's queries before their row's first kept
    key see only masked keys. With one mask term each key has the fill once (the mean of
    V); with two added (GPT-Neo) a causally hidden padded key is -inf, so the mean runs
    over the keys up to the query; with a finite fill the scores still count: both
    computed from the mask's rows when a row is left-padded."""
    meaning = Meaning(causal=True, alignment="bottom-right", kv_heads=2, padded=True,
                      fill=fill, mask_terms=mask_terms)
    model = cached_model(meaning)
    stage = lower_for_ort(model, FormPolicy(kv_cache="shared"))
    share_interface(model.graph, stage.layers)
    assert "per-row lengths" in stage.forms["block0"].kernel
    padded = np.zeros((3, 6), bool)
    padded[1, :2] = True
    padded[2, :5] = True
    f = cached_feeds(meaning, 3, 0, 6, padded)
    for name in ("k", "v"):
        f[f"past_{name}"] = np.zeros((3, 2, MAX, meaning.head), np.float32)
    f[LENGTH_INPUT] = np.array(0, np.int64)
    got = run_all(model, f)
    assert_matches(got["out"], reference(meaning, f))
