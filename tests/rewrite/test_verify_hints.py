"""What fuse says when its verification fails: the tolerance it would have needed, and for a
half-precision output that misses by a small factor, that the kernels round differently and
which --atol would accept it (after checking against the source model)."""

from __future__ import annotations

import numpy as np
import pytest

from mha_onnx.errors import FusionError
from mha_onnx.rewrite.check.mismatch import refuse_mismatch
from mha_onnx.rewrite.check.verify import CaseResult, Verification
from mha_onnx.stats import compare


def _refused(got: np.ndarray, want: np.ndarray) -> FusionError:
    result = CaseResult("longer", "logits", compare(got, want), got.dtype.name)
    with pytest.raises(FusionError) as raised:
        refuse_mismatch(Verification((result,)), [])
    return raised.value


def test_a_float16_near_miss_names_the_rounding_and_the_atol_that_accepts_it():
    want = np.zeros((2, 8), np.float16)
    got = want.copy()
    got[1, 3] = 0.0293  # past atol 0.02 + rtol 0.01 x 0
    error = _refused(got, want)
    assert "would need atol 0.0293" in str(error) and "rtol 0.01" in str(error)
    assert "float16 kernels may round differently" in error.hint
    assert "--atol 0.03 accepts it" in error.hint and "mha-onnx validate" in error.hint
    assert compare(got, want, atol=0.03).passed  # the value said does accept it


def test_a_far_miss_or_a_float32_miss_is_not_called_rounding():
    want = np.zeros((2, 8), np.float16)
    got = want.copy()
    got[0, 0] = 0.5  # 25x the tolerance
    assert "please report this model" in _refused(got, want).hint
    assert "round" not in _refused(got, want).hint
    want32, got32 = np.zeros(4, np.float32), np.array([0, 0, 3e-4, 0], np.float32)
    error = _refused(got32, want32)
    assert "round" not in error.hint and "would need atol 0.0003" in str(error)
