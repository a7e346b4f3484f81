"""lower_onnx (``--target onnx`` / ``openvino``): one Sdpa node onto the standard ONNX
Attention op (opset 23), run on ONNX Runtime: masks as ORT takes them, grouped K/V kept (or
repeated for OpenVINO), and fully masked rows set to what the original gives (ORT's
Attention itself returns zeros there)."""

from __future__ import annotations

import numpy as np
import pytest

from mha_onnx.rewrite.lower.attention import LowerToOnnxAttention
from tests.sdpa_graphs import Meaning, assert_matches, feeds, lower, ops, reference, run, sdpa_model

MIN32 = float(np.finfo(np.float32).min)


def _check(meaning: Meaning, s: int, t: int, padded=None, ungroup: bool = False):
    model = sdpa_model(meaning)
    form = lower(model, LowerToOnnxAttention, ungroup)["block0"]
    f = feeds(meaning, 4, s, t, padded)
    assert_matches(run(model, f), reference(meaning, f))
    assert "Attention" in ops(model)
    assert not ops(model) & {"MultiHeadAttention", "GroupQueryAttention"}
    return model, form


def test_no_mask_and_plain_causal_need_no_mask_tensor():
    _, form = _check(Meaning(), 5, 7)
    assert form.kernel == "Attention"
    _, form = _check(Meaning(causal=True, kv_heads=2), 6, 6)
    assert form.kernel == "Attention (is_causal)"


@pytest.mark.parametrize("fill, nan_to_zero", [(-np.inf, False), (-np.inf, True),
                                                (MIN32, False)],
                         ids=["nan", "nan-guard-zero", "mean-of-v"])
def test_key_padding_rows_all_padded_get_the_originals_value(fill, nan_to_zero):
    meaning = Meaning(padded=True, fill=fill, nan_to_zero=nan_to_zero, kv_heads=2)
    padded = np.zeros((4, 6), bool)
    padded[1, 4:] = True
    padded[2, :2] = True
    padded[3, :] = True
    _, form = _check(meaning, 3, 6, padded)
    assert form.kernel == "Attention + key mask [B,1,S,T]"


def test_windowed_causal_with_padding_as_a_bias():
    meaning = Meaning(causal=True, window=2, padded=True)
    padded = np.zeros((4, 6), bool)
    padded[2, :2] = True
    _, form = _check(meaning, 6, 6, padded)
    assert form.kernel == "Attention + attention bias"


def test_openvino_gets_every_head_its_own_kv():
    model, _ = _check(Meaning(causal=True, kv_heads=2), 5, 5, ungroup=True)
    attention = next(n for n in model.graph if n.op_type == "Attention")
    assert attention.inputs[1].producer() is not None  # K repeated before the op


def test_fully_masked_rows_where_two_fills_add_up():
    """GPT-Neo's causal scores replaced by the lowest float, then its padding mask added: a
    key both hide is -inf, a padded one the fill, so a fully padded row's query reads the
    mean of V over the keys up to it (its window), not over every key."""
    padded = np.zeros((4, 6), bool)
    padded[1, :3] = True  # left padding: its first queries see no kept key
    padded[3, :] = True  # every key padded
    for window in (0, 2):
        meaning = Meaning(causal=True, window=window, padded=True, fill=MIN32, mask_terms=2)
        _, form = _check(meaning, 6, 6, padded)
        assert form.kernel == "Attention + attention bias"
