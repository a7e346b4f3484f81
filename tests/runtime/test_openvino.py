"""OpenVINO as a second runtime (validate, profile): f32 pinned, its bf16 labelled and
compared at bf16 tolerances, refusals with OpenVINO's reason (exit 3), never a fallback."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.errors import ConfigError
from mha_onnx.parity import ValidateConfig, validate_model
from mha_onnx.runtime import make_runner
from mha_onnx.runtime.openvino import OpenVinoRunner, device_of, reduced_precision
from mha_onnx.runtime.ort import ProviderUnavailableError, parse_providers
from tests.conftest import SMALL
from tests.irgraphs import node, tensor

pytest.importorskip("openvino")


def _matmul_model():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [node("MatMul", ["x", "w"], "y"), node("Relu", ["y"], "z")], "mm",
        [tensor("x", TensorProto.FLOAT, ["B", 16])], [tensor("z", TensorProto.FLOAT, ["B", 16])],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_provider_names_and_devices():
    assert parse_providers("cpu,openvino,openvino-bf16,openvino:GPU") == (
        "cpu", "openvino", "openvino-bf16", "openvino:gpu")
    assert device_of("openvino") == "CPU" and device_of("openvino-bf16:npu") == "NPU"
    assert reduced_precision("openvino-bf16") and not reduced_precision("openvino")
    with pytest.raises(ConfigError, match="openvino"):
        parse_providers("openvinox")
    assert isinstance(make_runner(b"", "openvino"), OpenVinoRunner)


def test_f32_is_pinned_and_outputs_match_ort():
    m = _matmul_model().SerializeToString()
    x = {"x": np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)}
    with make_runner(m, "openvino", threads=2) as ov, make_runner(m, "cpu") as ort:
        assert ov.precision == "f32" and ov.output_names == ["z"]
        np.testing.assert_allclose(ov.infer(x)["z"], ort.infer(x)["z"], atol=1e-5)


def test_absent_device_and_uncompilable_model_are_refused_with_the_reason():
    m = _matmul_model().SerializeToString()
    with pytest.raises(ProviderUnavailableError, match="device NPU is not on this machine"):
        make_runner(m, "openvino:NPU").session  # noqa: B018
    from onnx import TensorProto, helper

    custom = helper.make_model(helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"], domain="com.example")], "g",
        [tensor("x", TensorProto.FLOAT, [2])], [tensor("y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    with pytest.raises(ProviderUnavailableError, match="OpenVINO .CPU. cannot compile"):
        make_runner(custom.SerializeToString(), "openvino").session  # noqa: B018


def test_missing_openvino_is_exit_3_not_a_fallback(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_openvino(name, *args, **kwargs):
        if name == "openvino":
            raise ImportError("No module named 'openvino'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_openvino)
    path = tmp_path / "m.onnx"
    path.write_bytes(_matmul_model().SerializeToString())
    result = CliRunner().invoke(main, ["validate", str(path), "--reference", str(path),
                                       "--providers", "openvino", "--json"])
    assert result.exit_code == 3, result.output
    status = json.loads(result.output)["providers"][0]
    assert not status["ran"] and "mha-onnx[openvino]" in status["reason"]


def test_validate_own_export_on_both_runtimes(export_cache):
    path = export_cache(SMALL.replace(mask="causal"))
    report = validate_model(path, ValidateConfig(providers=("cpu", "openvino", "openvino-bf16")))
    assert report, report.render()
    runtimes = {p.provider: p.runtime for p in report.providers}
    assert runtimes["openvino"].endswith("CPU f32")
    assert runtimes["openvino-bf16"].split()[-1] in ("bf16", "f16", "f32")  # the device's own
    worst = {p: max(c.stats.max_abs for c in report.comparisons if c.provider == p)
             for p in ("openvino", "openvino-bf16")}
    assert worst["openvino"] < 1e-5
    bf16 = [c for c in report.comparisons if c.provider == "openvino-bf16"]
    assert all(c.stats.atol == 6e-2 for c in bf16)  # bfloat16's tolerance, by its label


def test_fused_for_ort_is_refused_by_openvino_with_its_reason(export_cache, tmp_path):
    from mha_onnx.rewrite import fuse_file

    src = export_cache(SMALL.replace(mask="causal"))
    dst = tmp_path / "ort.onnx"
    fuse_file(src, dst)  # GroupQueryAttention without past: OpenVINO's frontend refuses it
    result = CliRunner().invoke(main, ["validate", str(dst), "--reference", str(src),
                                       "--providers", "openvino"])
    assert result.exit_code == 3, result.output
    assert "GroupQueryAttention" in result.output and "--target onnx" in result.output


def test_profile_times_both_runtimes_in_one_table(export_cache):
    path = export_cache(SMALL.replace(mask="none"))
    result = CliRunner().invoke(main, ["profile", str(path), "--providers", "cpu,openvino",
                                       "--seq-lens", "16", "--iters", "2", "--min-time", "0.01",
                                       "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert {p["provider"] for p in data["points"]} == {"cpu", "openvino"}
    assert data["machine"]["openvino"] and "openvino float32" in data["roofline_gflops"]


def test_fuse_for_openvino_is_verified_on_openvino(export_cache, tmp_path):
    """--target openvino: standard ops (no com.microsoft), verified case by case on
    OpenVINO f32 as well as on ORT; the metadata says which target it was fused for."""
    from mha_onnx.graph import metadata
    from mha_onnx.graph.files import read_model

    src = export_cache(SMALL.replace(mask="key-padding"))
    dst = tmp_path / "ov.onnx"
    result = CliRunner().invoke(main, ["fuse", str(src), "-o", str(dst), "--target", "openvino",
                                       "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    cases = [r["case"] for r in report["verification"]["results"]]
    assert any(c.endswith("on OpenVINO f32") for c in cases)
    assert any(not c.endswith("on OpenVINO f32") for c in cases)
    model = read_model(dst)
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    assert metadata.loaded(model, "fusion")["target"] == "openvino"
    check = validate_model(dst, ValidateConfig(providers=("cpu", "openvino"), reference=str(src)))
    assert check, check.render()


def test_the_shape_cache_bug_is_caught_and_the_workaround_is_checked(export_cache, monkeypatch):
    """OpenVINO 2026.4.1 (CPU, f32): the base no-mask export run at one token and then at a
    batch of two gives wrong outputs from one compiled model (docs/history/bench-notebook.md). validate says
    so; MHA_ONNX_OPENVINO_CONFIG passes OpenVINO properties (here the workaround) through."""
    from mha_onnx.config import load_preset

    path = export_cache(load_preset("base").replace(mask="none"))
    config = ValidateConfig(providers=("cpu", "openvino"), memory_check=False)
    found = validate_model(path, config)
    assert not found and {c.provider for c in found.failures()} == {"openvino"}
    monkeypatch.setenv("MHA_ONNX_OPENVINO_CONFIG", "CPU_RUNTIME_CACHE_CAPACITY=0")
    fixed = validate_model(path, config)
    assert fixed, fixed.render()
    assert "CPU_RUNTIME_CACHE_CAPACITY=0" in fixed.providers[1].runtime
    monkeypatch.setenv("MHA_ONNX_OPENVINO_CONFIG", "no-equals-sign")
    with pytest.raises(ConfigError, match="MHA_ONNX_OPENVINO_CONFIG"):
        make_runner(b"", "openvino")._config()
