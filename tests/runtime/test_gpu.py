"""CUDA execution provider tests: skipped with ORT's reason where the CUDA EP cannot start."""

from __future__ import annotations

import numpy as np
import pytest

from mha_onnx.config import MhaConfig
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.runtime.ort import OrtRunner, cuda_available, node_placement

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"CUDA EP unavailable: {_WHY}")]

CFG = MhaConfig(d_model=64, num_heads=4, name="gpu")


@pytest.fixture(scope="module")
def fused(export_cache, tmp_path_factory):
    from mha_onnx.rewrite import fuse_file

    out = {}
    for mask in ("none", "key-padding", "causal"):
        for dtype in ("float32", "float16"):
            cfg = CFG.replace(mask=mask, dtype=dtype)
            src = export_cache(cfg)
            dst = tmp_path_factory.mktemp("gpu") / "fused.onnx"
            fuse_file(src, dst)
            out[(mask, dtype)] = (src, dst)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("mask", ["none", "key-padding", "causal"])
def test_cuda_matches_pytorch_and_cpu(fused, mask, dtype):
    from mha_onnx.parity import ValidateConfig, validate_model

    src, dst = fused[(mask, dtype)]
    report = validate_model(dst, ValidateConfig(providers=("cpu", "cuda"), reference=str(src)))
    assert report, report.render()
    cuda = [p for p in report.providers if p.provider == "cuda"][0]
    assert cuda.ran and cuda.io_binding
    assert {c.provider for c in report.comparisons} == {"cpu", "cuda"}


def test_attention_kernels_run_on_the_gpu(fused):
    src, dst = fused[("none", "float32")]
    feeds = {"query": np.random.default_rng(0).standard_normal((2, 9, 64)).astype(np.float32)}
    placement = node_placement(str(dst), "cuda", feeds)
    kernels = {name: where for name, (op, where) in placement.items() if op == "MultiHeadAttention"}
    assert kernels and set(kernels.values()) == {"cuda"}


def test_io_binding_returns_host_arrays(fused):
    src, dst = fused[("causal", "float16")]
    feeds = {"query": np.random.default_rng(1).standard_normal((1, 33, 64)).astype(np.float16)}
    with OrtRunner(str(dst), "cuda", io_binding=True, strict=False) as gpu, OrtRunner(str(dst)) as cpu:
        got, want = gpu.infer(feeds)["output"], cpu.infer(feeds)["output"]
    assert got.dtype == np.float16 and np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-2, rtol=2e-2)


def test_profile_reports_device_memory(fused):
    from mha_onnx.profile import ProfileConfig, profile_models

    src, dst = fused[("none", "float16")]
    report = profile_models([dst], ProfileConfig(providers=("cuda",), seq_lens=(256,), iters=3,
                                                 io_binding=True, op_breakdown=True))
    (point,) = report.points
    assert point.error is None and point.p50_ms > 0
    assert any(o.provider == "cuda" for o in point.top_ops)
    pytest.importorskip("pynvml", reason="device memory is read through NVML (pynvml)")
    assert point.device_bytes is not None and point.device_bytes > 0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_shared_kv_cache_decodes_in_place_on_cuda(export_cache, tmp_path, dtype):
    """GQA on a CUDA buffer bound as past and present: a prompt and 16 steps against the
    appended export, on CPU and CUDA."""
    from mha_onnx.parity import ValidateConfig, validate_model
    from mha_onnx.rewrite import fuse_file

    src = export_cache(CFG.replace(mask="causal", kv_cache=True, dtype=dtype))
    dst = tmp_path / "shared.onnx"
    fuse_file(src, dst, policy=FormPolicy(kv_cache="shared"))
    report = validate_model(dst, ValidateConfig(providers=("cpu", "cuda"), reference=str(src)))
    assert report, report.render()
    assert any(c.provider == "cuda" and c.case.startswith("decode step 16")
               for c in report.comparisons)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("mask", ["none", "key-padding", "causal"])
def test_forms_for_cuda_run_every_attention_kernel_on_the_gpu(export_cache, tmp_path, mask, dtype):
    """`fuse --ep cuda`: parity on CUDA and no attention kernel left to the CPU (float32
    GroupQueryAttention has no CUDA kernel; the CPU forms' would run there)."""
    from mha_onnx.parity import ValidateConfig, validate_model
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.policy import FormPolicy

    src = export_cache(CFG.replace(mask=mask, dtype=dtype))
    dst = tmp_path / "cuda.onnx"
    fuse_file(src, dst, policy=FormPolicy.for_ep("cuda"))
    report = validate_model(dst, ValidateConfig(providers=("cpu", "cuda"), reference=str(src)))
    assert report, report.render()
    assert not report.notes, report.notes
