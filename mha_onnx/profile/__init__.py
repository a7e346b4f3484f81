"""``profile``: latency percentiles, throughput, achieved GFLOP/s against a measured matmul
roofline, peak memory and per-op time, per model x provider x batch x length x threads.

Parts: :mod:`.report` (config, points, report), :mod:`.sweep` (the run), :mod:`.worker`
(timing one point in a child process; public, used by tools/bench.py), :mod:`.roofline`
(machine and matmul ceiling), :mod:`.flops`, :mod:`.output` (CSV and plot).
"""

from __future__ import annotations

from mha_onnx.profile.flops import attention_flops
from mha_onnx.profile.output import plot, write_csv
from mha_onnx.profile.report import (
    DEFAULT_ITERS,
    DEFAULT_MIN_TIME,
    SCHEMA_VERSION,
    OpTime,
    Point,
    ProfileConfig,
    ProfileReport,
)
from mha_onnx.profile.sweep import check_memory, profile_models

__all__ = ["DEFAULT_ITERS", "DEFAULT_MIN_TIME", "SCHEMA_VERSION", "OpTime", "Point",
           "ProfileConfig", "ProfileReport", "attention_flops", "check_memory", "plot",
           "profile_models", "write_csv"]
