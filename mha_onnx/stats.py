"""Numerical comparison of two arrays with explicit, dtype-aware tolerances."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

# Default bounds by the dtype of the array under test (documented in the README).
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    # float32: relative too, as numpy.allclose (1e-5): a model whose logits are in the hundreds
    # differs by float32 rounding alone by more than any absolute bound meant for unit scale
    "float32": (1e-4, 1e-5),
    "float64": (1e-6, 0.0),
    "float16": (2e-2, 1e-2),
    "bfloat16": (6e-2, 4e-2),
}


def default_tolerance(dtype: np.dtype | str) -> tuple[float, float]:
    """(atol, rtol) for outputs of ``dtype``."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return DEFAULT_TOLERANCES.get(name, DEFAULT_TOLERANCES["float32"])


@dataclass(frozen=True)
class ErrorStats:
    """How ``actual`` differs from ``expected``; NaN in both at one place counts as equal."""

    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    mean_abs: float
    p99_abs: float
    mismatch_fraction: float
    cosine: float
    nan_actual: int
    inf_actual: int
    nan_expected: int
    nan_where_expected_finite: int
    atol: float
    rtol: float
    needed_atol: float

    @property
    def passed(self) -> bool:
        return self.mismatch_fraction == 0.0 and self.nan_where_expected_finite == 0

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        data["passed"] = self.passed
        return data


def compare(
    actual: np.ndarray, expected: np.ndarray, *, atol: float | None = None, rtol: float | None = None
) -> ErrorStats:
    """Elementwise |actual - expected| <= atol + rtol * |expected| over float64 copies."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape} != expected {expected.shape}")
    default_atol, default_rtol = default_tolerance(actual.dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    a = actual.astype(np.float64, copy=False)
    e = expected.astype(np.float64, copy=False)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    both_nan = nan_a & nan_e
    same_inf = np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))
    equalish = both_nan | same_inf
    diff = np.where(equalish, 0.0, np.abs(a - e))
    diff = np.where(np.isnan(diff), np.inf, diff)
    bound = atol + rtol * np.abs(np.where(np.isfinite(e), e, 0.0))
    mismatch = diff > bound
    finite = np.isfinite(diff)
    size = max(diff.size, 1)
    rel = diff / np.maximum(np.abs(np.where(np.isfinite(e), e, 0.0)), 1e-12)
    rel = np.where(equalish, 0.0, rel)
    both_finite = np.isfinite(a) & np.isfinite(e)
    av, ev = a[both_finite], e[both_finite]
    denom = float(np.linalg.norm(av) * np.linalg.norm(ev))
    cosine = float(np.dot(av.ravel(), ev.ravel()) / denom) if denom > 0 else 1.0
    over = diff - rtol * np.abs(np.where(np.isfinite(e), e, 0.0))
    return ErrorStats(
        shape=tuple(actual.shape),
        max_abs=float(diff.max()) if diff.size else 0.0,
        max_rel=float(rel.max()) if rel.size else 0.0,
        mean_abs=float(diff[finite].mean()) if finite.any() else 0.0,
        p99_abs=float(np.percentile(diff[finite], 99)) if finite.any() else 0.0,
        mismatch_fraction=float(mismatch.sum()) / size,
        cosine=cosine,
        nan_actual=int(nan_a.sum()),
        inf_actual=int(np.isinf(a).sum()),
        nan_expected=int(nan_e.sum()),
        nan_where_expected_finite=int((nan_a & ~nan_e).sum()),
        atol=atol,
        rtol=rtol,
        needed_atol=float(max(over.max(), 0.0)) if over.size else 0.0,
    )
