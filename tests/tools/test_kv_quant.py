"""tools/experiments/kv_quant.py: ORT's CPU GroupQueryAttention on a quantized shared
cache runs, and its figures are what the experiment says they are."""

from __future__ import annotations

import argparse

from tools.experiments import kv_quant


def test_each_cache_form_runs_a_prompt_and_a_step_on_a_shared_buffer():
    args = argparse.Namespace(heads=4, kv_heads=2, head_size=16, threads=1, steps=1, rounds=1)
    result = kv_quant.measure(64, args)
    assert set(result) == set(kv_quant.FORMS)
    times, error, cosine, nbytes = result["float32"]
    assert error == 0.0 and cosine > 0.999999 and len(times) == 1
    int8 = result["int8, per channel"]
    assert int8[3] * 4 == nbytes  # (a quarter of the bytes)
    assert 0 < int8[1] < 0.1 and int8[2] > 0.999  # close to the float cache, not equal
    assert result["int4, per channel"][3] * 8 == nbytes
