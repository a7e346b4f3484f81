"""What a newcomer's first hour hit (issue: the house, turn 4), each as a test: bad input
is one line and exit 2, a bug exit 4 (tests/cli/test_checks_that_fail.py), -v works after the
command, the outputs of an encoder are named, validate summarises, profile shows the top
ops of models timed in turn, report keeps a forward run and a decode step apart
(tests/serve/test_package.py)."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_truncated_weights_file_is_bad_input(hf_folder, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(hf_folder("llama"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = _cli("export", "--model", folder, "-o", tmp_path / "x.onnx")
    assert result.exit_code == 2, result.output
    assert "cannot load" in result.output and "internal error" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "x.onnx").exists()


def test_a_task_the_model_cannot_have_is_refused_before_loading(hf_folder, tmp_path):
    result = _cli("export", "--model", hf_folder("llama"), "--task",
                  "image-feature-extraction", "-o", tmp_path / "x.onnx")
    assert result.exit_code == 2, result.output
    assert "does not fit" in result.output and "text-generation-with-past" in result.output
    assert "[export]" not in result.output  # nothing loaded, nothing exported


def test_what_torch_export_says_is_one_short_line(hf_folder, tmp_path):
    """An encoder-decoder exported as an encoder alone: torch.export fails inside T5's
    forward; the line says why in a sentence, not in pages of torch.onnx's advice."""
    result = _cli("export", "--model", hf_folder("t5"), "--task", "feature-extraction",
                  "-o", tmp_path / "x.onnx")
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and len(error[0]) < 420, error
    assert "ValueError: You must specify" in error[0] and "-v shows" in error[0]
    assert "Next steps" not in result.output and "exportdb" not in result.output


def test_decoder_options_on_an_encoder_are_refused_before_the_export(hf_folder, tmp_path):
    for option in (("--kv-cache", "shared"), ("--logits", "last")):
        result = _cli("export", "--model", hf_folder("bert"), *option, "-o", tmp_path / "x.onnx")
        assert result.exit_code == 2 and "is for decoders" in result.output, result.output
        assert "[export]" not in result.output


def test_an_encoders_pooler_output_is_named_and_validated(hf_folder, tmp_path):
    out = tmp_path / "bert.onnx"
    result = _cli("export", "--model", hf_folder("bert"), "-o", out, "--json")
    assert result.exit_code == 0, result.output
    assert [o.name for o in onnx.load(out).graph.output] == ["last_hidden_state",
                                                           "pooler_output"]
    report = json.loads(result.output[result.output.index("{"):])
    assert {c["output"] for c in report["validation"]["comparisons"]} == {
        "last_hidden_state", "pooler_output"}


@pytest.mark.models
def test_validate_summarises_and_v_after_the_command_lists_every_comparison(tmp_path):
    from mha_onnx.rewrite import fuse_file
    from tests.rewrite.test_optimum import FIXTURES

    source = FIXTURES / "llama" / "model.onnx"
    fused = tmp_path / "model.onnx"
    fuse_file(source, fused)
    summary = _cli("validate", fused, "--reference", source)
    assert summary.exit_code == 0, summary.output
    lines = summary.output.strip().splitlines()
    assert len(lines) < 40 and "comparisons" in summary.output, summary.output
    assert "decode step 16" in summary.output and "PASSED" in lines[-1]
    detail = _cli("validate", fused, "--reference", source, "-v")
    assert detail.exit_code == 0 and len(detail.output.splitlines()) > 100
    assert "decode (no key padded) step 16" in detail.output


@pytest.mark.timing
def test_profile_shows_the_top_ops_of_models_timed_in_turn(tmp_path):
    from mha_onnx.rewrite import fuse_file
    from tests.rewrite.test_optimum import FIXTURES

    source = FIXTURES / "bert" / "model.onnx"
    fused = tmp_path / "fused.onnx"
    fuse_file(source, fused)
    result = _cli("profile", source, fused, "--seq-lens", "16", "--iters", "2", "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.output[result.output.index("{"):])["points"]
    assert len(points) == 2 and all(p["top_ops"] for p in points), points
    ops = {p["model"]: {o["op_type"] for o in p["top_ops"]} for p in points}
    assert ops[str(fused)] & {"MultiHeadAttention", "GroupQueryAttention"}, ops
    assert not ops[str(source)] & {"MultiHeadAttention", "GroupQueryAttention"}


def test_form_kv_cache_shared_is_not_overridden_by_the_default(export_cache, tmp_path):
    """`--form kv_cache=shared` shares the cache (the CLI's --kv-cache default used to
    override it silently); --kv-cache and --form that disagree are refused."""
    from mha_onnx.graph.cache import is_shared
    from tests.conftest import SMALL

    source = export_cache(SMALL.replace(mask="causal", kv_cache=True))
    out = tmp_path / "shared.onnx"
    result = _cli("fuse", source, "-o", out, "--form", "kv_cache=shared")
    assert result.exit_code == 0, result.output
    assert is_shared(onnx.load(out))
    clash = _cli("fuse", source, "-o", tmp_path / "x.onnx", "--form", "kv_cache=shared",
                 "--kv-cache", "appended")
    assert clash.exit_code == 2 and "disagree" in clash.output


@pytest.mark.timing
def test_profile_gives_graph_gflops_for_a_model_exported_elsewhere(tmp_path):
    """A model without mha-onnx's config (an Optimum export): GFLOP/s from the work its
    matrix kernels did in the profiled runs (it was '-')."""
    from tests.rewrite.test_optimum import FIXTURES

    result = _cli("profile", FIXTURES / "bert" / "model.onnx", "--seq-lens", "32", "--iters",
                  "2", "--json")
    assert result.exit_code == 0, result.output
    (point,) = json.loads(result.output[result.output.index("{"):])["points"]
    # BERT here: 2 layers of hidden 64, FFN 128, 4 heads; batch 1 x 32 tokens
    layer = 2 * 32 * 64 * (4 * 64 + 2 * 128) + 4 * 32 * 32 * 64
    assert point["gflop"] * 1e9 >= 2 * layer and point["gflops"] > 0
    assert point["roofline_fraction"] is not None


@pytest.mark.transformers
def test_an_object_detector_is_not_taken_for_a_text2text_model(tmp_path):
    """DETR's config says encoder-decoder; without a vocabulary it is not a T5 (it was
    loaded as one and failed in AutoModelForSeq2SeqLM with a page of class names)."""
    import transformers as tf

    tf.DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False).save_pretrained(
        tmp_path / "detr")
    result = _cli("export", "--model", tmp_path / "detr", "-o", tmp_path / "x.onnx")
    assert result.exit_code == 2, result.output
    assert "without a vocabulary" in result.output and "Optimum" in result.output
    assert "[export]" not in result.output and len(result.output.strip().splitlines()) == 1


def test_fusing_a_graph_that_neither_runtime_runs_is_one_line_not_an_internal_error(tmp_path):
    """GenAI's builder graph (already fused: its GQA refuses the generated batch of 2 with a
    past, and ONNX's reference evaluator has no contrib operators): the verification's
    original cannot run. It said "internal error: NotImplementedError" (exit 4); now one line
    naming both refusals and the way on, exit 2."""
    from tests.paths import FIXTURES

    result = _cli("fuse", FIXTURES / "genai" / "llama-fp32" / "model.onnx", "-o",
                  tmp_path / "out.onnx")
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "internal error" not in result.output
    assert "cannot run the original model to verify against: ORT CPU refused it" in error[0]
    assert "reference evaluator raised NotImplementedError" in error[0]
    assert "--inputs FILE.npz" in error[0]
    assert not (tmp_path / "out.onnx").exists()


def test_an_output_folder_nothing_can_be_written_into_is_refused_before_the_export(
        hf_folder, tmp_path):
    """(/proc takes no new file, for root too: a read-only folder as every user meets it)"""
    result = _cli("export", "--model", hf_folder("bert"), "-o", "/proc/model.onnx")
    assert result.exit_code == 2, result.output
    assert "cannot write into /proc" in result.output and "[export]" not in result.output


def test_an_encoder_exported_as_a_decoder_is_refused_before_torch_export(hf_folder, tmp_path):
    """BERT loads under a causal-LM head (BertLMHeadModel) and returns no cache: refused
    after one eager step, not after torch.export's minutes with an AttributeError."""
    result = _cli("export", "--model", hf_folder("bert"), "--task", "text-generation-with-past",
                  "-o", tmp_path / "new" / "x.onnx")
    assert result.exit_code == 2, result.output
    assert "returns no cache" in result.output and "feature-extraction" in result.output
    assert "internal error" not in result.output and "torch.export" not in result.output
    assert not (tmp_path / "new").exists()  # the folder it made for the output: gone too


def test_an_interrupted_export_exits_130_and_leaves_no_folder(hf_folder, tmp_path):
    """Ctrl-C during torch.export: exit 130 with one line, and the output's folder (made
    for it) is not left behind empty."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "new" / "deeper" / "x.onnx"
    proc = subprocess.Popen([sys.executable, "-m", "mha_onnx.cli", "export", "--model",
                             str(hf_folder("bert")), "-o", str(out)],
                            stderr=subprocess.PIPE, text=True,
                            # (a suite started in the background has SIGINT ignored, and a
                            # child inherits that: Python would not install its handler)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:  # bounded: the export ends by itself if never interrupted
        seen.append(line)
        if "torch.export" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted; no output was written" in rest and "Traceback" not in rest
    assert not (tmp_path / "new").exists()
