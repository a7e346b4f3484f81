"""lower_gqa: causal Sdpa nodes onto GroupQueryAttention (grouped K/V, windows, soft-capping,
right padding behind its run-time check, top-left alignment), each checked for its kernel,
its guard, and parity on both sides of the guard, fully padded rows included."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from mha_onnx.rewrite.lower.gqa import gqa_ok
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.sdpa import SdpaInfo
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


def _lowered(meaning: Meaning):
    model = sdpa_model(meaning)
    form = lower_for_ort(model, FormPolicy()).forms["block0"]
    return model, form


def _check(model, meaning: Meaning, s: int, t: int, padded=None, atol: float = 2e-5):
    f = feeds(meaning, 4, s, t, padded)
    assert_matches(run(model, f), reference(meaning, f), atol=atol)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "grouped", "one-kv-head"])
def test_causal_is_one_gqa_node_with_grouped_kv(kv_heads):
    meaning = Meaning(causal=True, kv_heads=kv_heads)
    model, form = _lowered(meaning)
    assert form.kernel.startswith("GroupQueryAttention") and not form.guard
    assert "If" not in ops(model) and "GroupQueryAttention" in ops(model)
    for length in (1, 7):
        _check(model, meaning, length, length)


@pytest.mark.parametrize("window, softcap", [(3, 0.0), (0, 5.0), (2, 5.0)])
def test_windows_and_softcapping_are_gqa_attributes(window, softcap):
    meaning = Meaning(causal=True, kv_heads=2, window=window, softcap=softcap)
    model, _ = _lowered(meaning)
    gqa = [n for n in ir.traversal.RecursiveGraphIterator(model.graph)
           if n.op_type == "GroupQueryAttention"]
    assert gqa
    windows = {n.attributes["local_window_size"].as_int() for n in gqa
               if "local_window_size" in n.attributes}
    caps = {n.attributes["softcap"].as_float() for n in gqa if "softcap" in n.attributes}
    assert windows == ({window} if window else set()) or (not window and windows == {-1})
    assert caps == ({softcap} if softcap else set()) or (not softcap and caps == {0.0})
    _check(model, meaning, 6, 6)


def test_causal_with_key_padding_runs_gqa_only_when_every_row_is_right_padded():
    meaning = Meaning(causal=True, kv_heads=2, padded=True)
    model, form = _lowered(meaning)
    assert form.guard and form.otherwise is not None
    assert {"If", "GroupQueryAttention", "MultiHeadAttention"} <= ops(model)
    right = np.zeros((4, 6), bool)
    right[1, 4:] = True
    _check(model, meaning, 6, 6, right)  # the GQA branch
    left = right.copy()
    left[2, :2] = True  # left padding: queries with no key at all (NaN as the original)
    left[3, :] = True
    _check(model, meaning, 6, 6, left)  # the general branch


@pytest.mark.parametrize("s, t", [(3, 7), (7, 3)], ids=["S<T", "S>T"])
def test_top_left_alignment(s, t):
    """PyTorch's is_causal with S != T: GQA over the first S keys when S <= T."""
    meaning = Meaning(causal=True, alignment="top-left")
    model, form = _lowered(meaning)
    assert "GroupQueryAttention" in ops(model)
    _check(model, meaning, s, t)


def test_half_precision_causal():
    meaning = Meaning(causal=True, kv_heads=2, dtype=ir.DataType.FLOAT16)
    model, _ = _lowered(meaning)
    assert "GroupQueryAttention" in ops(model)
    _check(model, meaning, 5, 5, atol=3e-3)


def test_gqa_refuses_what_it_cannot_compute():
    """Different K and V head sizes, head sizes not a multiple of 8, or no causal mask."""
    def info(meaning: Meaning) -> SdpaInfo:
        node = next(iter(sdpa_model(meaning).graph))
        return SdpaInfo.of(node)

    assert gqa_ok(info(Meaning(causal=True)))
    assert not gqa_ok(info(Meaning(causal=True, head=12)))
    assert not gqa_ok(info(Meaning(causal=False)))


def test_soft_capping_holds_in_the_general_branch_too():
    """Left-padded rows leave GQA for MultiHeadAttention + the dense mask, which has no
    ``softcap``: that branch computes the capped scores itself. A cap of 1 binds on every
    score (random weights keep Gemma's 50 from ever binding, so parity there proves nothing)."""
    meaning = Meaning(causal=True, kv_heads=2, padded=True, softcap=1.0)
    model, form = _lowered(meaning)
    assert form.guard and "softcap 1" in form.kernel
    right = np.zeros((4, 6), bool)
    right[1, 4:] = True
    _check(model, meaning, 6, 6, right)  # GQA
    left = right.copy()
    left[2, :2] = True
    _check(model, meaning, 6, 6, left)  # the general branch
