"""What fuse says when the fused graph's outputs differ from the original's: the first
output that differs, and why where it can tell (the original's own NaN, half-precision
rounding)."""

from __future__ import annotations

import numpy as np

from mha_onnx.errors import FusionError
from mha_onnx.rewrite.check.verify import CaseResult, Verification


def refuse_mismatch(verification: Verification, unguarded: list[str]) -> None:
    """A FusionError naming the first output that differs (nothing is written then); where
    the original itself gives NaN there, why (``unguarded``: its RMS norms without an
    epsilon)."""
    failure = verification.first_failure()
    if failure is not None:
        stats = failure.stats
        why = ""
        if stats.nan_expected and not stats.nan_where_expected_finite:
            why = (f"; the original itself gives NaN in {stats.nan_expected} values there (the"
                   " fused graph nowhere else): " + (
                       f"its RMS normalisation {unguarded[0]} has no epsilon (an exporter "
                       "dropped one <= 1e-8)" if unguarded else
                       "the generated inputs may be outside what the model is defined for"))
        raise FusionError(
            f"fused graph differs from the original: output {failure.output!r} at "
            f"{failure.case}: max abs error {stats.max_abs:.3g} (atol {stats.atol:g} + rtol "
            f"{stats.rtol:g} x |original|; would need atol {stats.needed_atol:.3g}){why}; "
            "nothing was written",
            hint=_rounding_hint(failure) or _mismatch_hint(bool(why), bool(unguarded)))


ROUNDING = 4.0  # a half-precision miss within this many times the tolerance: rounding?


def _rounding_hint(failure: CaseResult) -> str | None:
    """For a half-precision output that misses by a small factor: the fused kernels (which
    accumulate in float32 where the original's ops round each step, or the reverse) may
    round differently; say which --atol would accept it, and how to check first."""
    stats = failure.stats
    if failure.dtype not in ("float16", "bfloat16") or stats.nan_where_expected_finite \
            or not 0 < stats.needed_atol <= ROUNDING * stats.atol:
        return None
    return (f"{failure.dtype} kernels may round differently from the original's ops (a miss "
            f"within {ROUNDING:g}x the tolerance): --atol {_round_up(stats.needed_atol)} accepts "
            "it; check the outputs against the source model (`mha-onnx validate`; `export "
            "--model` does after fusing); else please report this model")


def _round_up(value: float) -> str:
    """``value`` rounded up to two significant digits."""
    digits = 1 - int(np.floor(np.log10(value)))
    return f"{np.ceil(value * 10 ** digits) / 10 ** digits:g}"


def _mismatch_hint(original_nan: bool, unguarded: bool) -> str:
    if original_nan and unguarded:
        return ("re-export without torch.onnx's optimizer (optimize=False) or with "
                "`mha-onnx export --model`; --no-verify writes it anyway")
    if original_nan:
        return ("verify with real inputs (--inputs FILE.npz); else please report this model; "
                "--no-verify writes it anyway")
    return "please report this model; --no-verify writes it anyway"
