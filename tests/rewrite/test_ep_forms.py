"""The form policy per execution provider (`fuse --ep`), CUDA session options and
validate's placement warnings: the choices measured on CUDA (docs/gpu/2026-11-30-h200.md), checked here on the
CPU, where every form is verified against the original before it is written."""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.errors import ConfigError
from mha_onnx.graph import metadata
from mha_onnx.parity.report import ProviderStatus
from mha_onnx.parity.run import placement_notes
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.runtime.ort import OrtRunner
from tests.conftest import SMALL
from tests.fusing import fused_and_checked, ops


def test_forms_per_provider():
    assert FormPolicy.parse([]) == FormPolicy()
    cuda = FormPolicy.parse([], "cuda")
    assert (cuda.causal, cuda.key_padding, cuda.ep) == ("unidirectional", "bias", "cuda")
    assert FormPolicy.parse(["causal=gqa"], "cuda").causal == "gqa"  # --form still overrides
    assert FormPolicy.parse([], "tensorrt").causal == "unidirectional"
    # GQA elsewhere than the CPU only for what no other kernel does exactly
    assert not cuda.gqa_for() and cuda.gqa_for(softcap=True) and cuda.gqa_for(window=True)
    assert FormPolicy().gqa_for()
    with pytest.raises(ConfigError, match="execution provider"):
        FormPolicy.parse([], "rocm")


def test_cuda_sessions_pin_float32_matmuls():
    """ORT's CUDA EP rounds float32 MatMuls through TF32 unless told not to (found on an
    H200: 1.8e-4 off in a float32 model)."""
    assert OrtRunner(b"", "cuda")._provider_options() == {"use_tf32": "0"}
    assert OrtRunner(b"", "cuda", tf32=True)._provider_options() == {"use_tf32": "1"}
    assert OrtRunner(b"", "cpu")._provider_options() == {}


def _fuse(tmp_path, source, *extra):
    out = tmp_path / "fused.onnx"
    result = CliRunner().invoke(main, ["fuse", str(source), "-o", str(out), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output), onnx.load(out)


@pytest.mark.parametrize("mask, form", [
    ("causal", "MultiHeadAttention (unidirectional)"),
    ("key-padding", "MultiHeadAttention + key padding bias"),
])
def test_fuse_for_cuda_uses_the_forms_measured_there(export_cache, tmp_path, mask, form):
    report, fused = _fuse(tmp_path, export_cache(SMALL.replace(mask=mask)), "--ep", "cuda")
    assert [b["form"] for b in report["blocks"]] == [form]
    assert report["verification"]["passed"]
    kinds = ops(fused)
    assert "MultiHeadAttention" in kinds
    assert not {"GroupQueryAttention", "If", "Loop"} & set(kinds)
    assert metadata.loaded(fused, "fusion")["ep"] == "cuda"


def test_fuse_default_is_the_cpu_forms(export_cache, tmp_path):
    report, fused = _fuse(tmp_path, export_cache(SMALL.replace(mask="causal")))
    assert "GroupQueryAttention" in ops(fused)
    assert metadata.loaded(fused, "fusion")["ep"] == "cpu"


def test_causal_padding_on_cuda_takes_no_right_padded_gqa(zoo):
    """Causal + key padding: the CPU takes If(right padding) GQA with seqlens_k, which
    disagreed with the original on CUDA in float16; --ep cuda uses MHA + the mask."""
    model = zoo("spelled_triu1_bool_padded")
    cpu, _ = fused_and_checked(model)
    assert "GroupQueryAttention" in ops(cpu)
    from mha_onnx.rewrite import fuse_model

    cuda, results, _ = fuse_model(model, FormPolicy.for_ep("cuda"))
    assert "GroupQueryAttention" not in ops(cuda) and "MultiHeadAttention" in ops(cuda)
    assert [r.form for r in results] == ["MultiHeadAttention + attention_bias"]


def test_validate_warns_of_attention_on_the_cpu_and_of_forms_for_another_provider(
        export_cache, tmp_path):
    report, fused = _fuse(tmp_path, export_cache(SMALL.replace(mask="causal")))
    statuses = [ProviderStatus("cpu", True),
                ProviderStatus("cuda", True, cpu_nodes=("gqa_0 (GroupQueryAttention)",
                                                        "shape_3 (Concat)"))]
    notes = placement_notes(fused, statuses)
    assert any("1 attention kernel(s) on the CPU: gqa_0 (GroupQueryAttention)" in n
               for n in notes)
    assert any("fuse --ep cuda" in n for n in notes)
    _, for_cuda = _fuse(tmp_path / "c", export_cache(SMALL.replace(mask="causal")),
                        "--ep", "cuda")
    assert placement_notes(for_cuda, [ProviderStatus("cuda", True)]) == []
    assert placement_notes(fused, [ProviderStatus("cpu", True)]) == []
