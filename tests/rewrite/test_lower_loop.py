"""lower_loop: key padding as a Loop over the batch (each entry's padded keys compressed
away, unmasked MultiHeadAttention on the rest), and what an entry whose keys are all padded
gets: NaN (a -inf fill), 0 (a NaN guard), the mean of V (a fill the scores vanish into) or
softmax(scores + fill) (a finite additive fill such as -10000)."""

from __future__ import annotations

import numpy as np
import pytest

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


def _padding(t: int) -> np.ndarray:
    padded = np.zeros((4, t), bool)
    padded[1, t - 2:] = True  # right
    padded[2, :3] = True  # left
    padded[3, :] = True  # every key
    return padded


@pytest.mark.parametrize("fill, nan_to_zero", [
    (-np.inf, False), (-np.inf, True), (float(np.finfo(np.float32).min), False), (-1e4, False)],
    ids=["nan", "nan-guard", "mean-of-v", "additive-fill"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_every_entry_as_the_original(fill, nan_to_zero, kv_heads):
    meaning = Meaning(padded=True, fill=fill, nan_to_zero=nan_to_zero, kv_heads=kv_heads)
    model = sdpa_model(meaning)
    form = lower_for_ort(model, FormPolicy(key_padding="loop")).forms["block0"]
    assert form.kernel == "Loop(Compress keys) + MultiHeadAttention"
    assert {"Loop", "Compress", "MultiHeadAttention"} <= ops(model)
    for s, t in ((3, 8), (8, 8), (1, 9)):
        f = feeds(meaning, 4, s, t, _padding(t))
        assert_matches(run(model, f), reference(meaning, f))
