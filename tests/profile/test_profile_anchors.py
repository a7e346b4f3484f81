"""`profile ORIGINAL OURS ANCHOR`: files written by ONNX Runtime's transformers optimizer and by
ORT GenAI's model builder (tests/fixtures/genai, made by tools/genai_fixtures.py) time at every
point beside ours, prompt and decode step; a model that fails at a point fails its own rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from tests.paths import FIXTURES as FIXTURES_DIR

pytestmark = pytest.mark.timing  # every test here times models beside the anchors

FIXTURES = FIXTURES_DIR


def _profile(*args) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["profile", *map(str, args), "--iters", "2", "--warmup",
                                       "1", "--json"])
    return result.exit_code, json.loads(result.output[result.output.index("{"):])


def _fused(source: Path, out: Path) -> Path:
    result = CliRunner().invoke(main, ["fuse", str(source), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _ort_optimized(source: Path, out: Path, model_type: str, heads: int = 0,
                   hidden: int = 0) -> Path:
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(str(source), model_type=model_type, num_heads=heads,
                   hidden_size=hidden).save_model_to_file(str(out))
    return out


def _every_point_ran(report: dict, models: list[Path], points: int) -> None:
    rows = report["points"]
    assert len(rows) == points * len(models), [(r["model"], r["error"]) for r in rows]
    assert not [(r["model"], r["error"]) for r in rows if r["error"] or not r["p50_ms"]]
    assert {r["model"] for r in rows} == {str(m) for m in models}


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_bert_beside_ort_optimizer_at_every_point(family, tmp_path):
    """EmbedLayerNormalization holds the embedding Gather: the ids profile makes stay within
    its vocabulary (128 here, under the 256 positions), and the contrib Attention's FLOPs
    count."""
    source = FIXTURES / "optimum" / family / "model.onnx"
    models = [source, _fused(source, tmp_path / "ours.onnx"),
              _ort_optimized(source, tmp_path / "ort.onnx", "bert")]
    code, report = _profile(*models, "--batch", "1,3", "--seq-lens", "16,200")
    assert code == 0
    _every_point_ran(report, models, 4)
    ort = [r for r in report["points"] if r["model"] == str(models[2])]
    assert all(r["gflop"] and r["top_ops"] for r in ort)
    assert any(op["op_type"] == "EmbedLayerNormalization" for r in ort for op in r["top_ops"])


def test_decoders_of_ort_optimizer_and_genai_builder_at_every_point(tmp_path):
    """An Optimum Llama, ours fused, ORT's optimizer's (model_type gpt2) and GenAI's builder's
    fp32 and int4 (MatMulNBits; its cache dims symbolic beside its GQA): the prompt and the
    decode step, every point."""
    source = FIXTURES / "optimum" / "llama" / "model.onnx"
    cfg = json.loads((source.parent / "config.json").read_text())
    models = [source, _fused(source, tmp_path / "ours.onnx"),
              _ort_optimized(source, tmp_path / "ort.onnx", "gpt2",
                             cfg["num_attention_heads"], cfg["hidden_size"]),
              FIXTURES / "genai" / "llama-fp32" / "model.onnx",
              FIXTURES / "genai" / "llama-int4" / "model.onnx"]
    code, report = _profile(*models, "--batch", "1,2", "--seq-lens", "16,64")
    assert code == 0
    _every_point_ran(report, models, 4)
    code, report = _profile(*models, "--batch", "1,2", "--decode", "--context", "32,100")
    assert code == 0
    _every_point_ran(report, models, 4)


def test_a_model_that_fails_at_a_point_fails_only_its_own_rows(tmp_path):
    """The BERT fixture has 256 positions: at 300 tokens it fails there, and the ViT timed
    beside it (it has no length) still runs: its row stands, the exit status says 1."""
    source = FIXTURES / "optimum" / "bert" / "model.onnx"
    vit = FIXTURES / "optimum" / "vit" / "model.onnx"
    code, report = _profile(source, vit, "--seq-lens", "300", "--keep-going", "--no-ops")
    rows = {Path(r["model"]).parent.name: r for r in report["points"]}
    assert code == 1 and rows["bert"]["error"] and rows["bert"]["p50_ms"] is None
    assert not rows["vit"]["error"] and rows["vit"]["p50_ms"] > 0


def test_genai_builders_cache_heads_and_head_size_are_read_from_its_attention():
    """GenAI names the head size `kv_cache_dim`: pinned from the GQA node reading the cache
    (2 K/V heads of 16: the packed QKV's width 128 over 4 + 2 * 2 heads), fp32's MatMul or
    int4's MatMulNBits alike."""
    import onnx

    from mha_onnx.graph.images import _cache_dims

    for precision in ("fp32", "int4"):
        model = onnx.load(FIXTURES / "genai" / f"llama-{precision}" / "model.onnx",
                          load_external_data=False)
        dims = _cache_dims(model)
        assert set(dims) == {f"past_key_values.{i}.{kv}" for i in (0, 1)
                             for kv in ("key", "value")}
        assert set(dims.values()) == {(2, 16)}


def test_models_are_named_by_as_much_of_their_paths_as_tells_them_apart():
    from mha_onnx.profile.report import short_names

    assert short_names(["a/genai/model.onnx", "a/fused/model.onnx", "b/x.onnx"]) == {
        "a/genai/model.onnx": "genai/model.onnx", "a/fused/model.onnx": "fused/model.onnx",
        "b/x.onnx": "x.onnx"}
    assert short_names(["m.onnx", "m.onnx"]) == {"m.onnx": "m.onnx"}


def test_a_decode_step_of_genai_builders_graph_attends_to_every_cached_position():
    """GenAI's builder names its mask's length `total_sequence_length`, apart from the cache's
    `past_sequence_length`: profile's decode step gives it past + 1 positions. Left at the new
    token's length, ORT's GroupQueryAttention read a total of 1 and attended to none of the
    cached positions, without an error (its steps timed as if the context were empty)."""
    import numpy as np

    from mha_onnx.graph.files import read_model
    from mha_onnx.profile.feeds import decode_feeds
    from mha_onnx.runtime.ort import OrtRunner

    path = FIXTURES / "genai" / "llama-int4" / "model.onnx"
    feeds = decode_feeds(read_model(path, load_external_data=False), 2, 40)
    assert feeds["attention_mask"].shape == (2, 41)
    assert feeds["past_key_values.0.key"].shape[2] == 40
    with OrtRunner(path, "cpu") as runner:
        logits = runner.infer(feeds)["logits"]
        changed = {**feeds, **{k: v.copy() for k, v in feeds.items() if k.startswith("past")}}
        for name in (k for k in changed if k.startswith("past")):
            changed[name][:, :, 20] += 3.0  # one cached position in the middle
        assert not np.allclose(runner.infer(changed)["logits"], logits, atol=1e-4)


def test_genai_builders_graph_is_timed_on_buffers_shared_in_place_as_genai_runs_it(tmp_path):
    """Its genai_config.json says past_present_share_buffer: profile binds one buffer per
    cache as past and present (no length input: GenAI's graph reads it from the mask), as
    GenAI's generator does; the step reads every cached position (its logits are the
    appended run's) and writes the new one in place. Without that config beside it, the
    graph runs appended."""
    import shutil

    import numpy as np

    from mha_onnx.profile.feeds import bound_run, point_feeds, target
    from mha_onnx.runtime.ort import OrtRunner

    path = FIXTURES / "genai" / "llama-int4" / "model.onnx"
    form = target(str(path))
    assert form.shared and form.genai
    feeds = point_feeds(form, 2, 40, decode=True)
    assert "past_sequence_length" not in feeds and feeds["attention_mask"].shape == (2, 41)
    assert {v.shape[2] for k, v in feeds.items() if k.startswith("past")} == {41}
    appended = {k: v[:, :, :40] if k.startswith("past") else v for k, v in feeds.items()}
    with OrtRunner(path, "cpu") as runner:
        want = runner.infer(appended)
        np.testing.assert_allclose(runner.infer(feeds)["logits"], want["logits"], atol=1e-5)
        bound_run(runner, feeds, form)()  # (the buffers are the feeds' arrays, not copies)
    for name in (k for k in feeds if k.startswith("past")):
        present = want[name.replace("past_key_values", "present")]
        np.testing.assert_allclose(feeds[name][:, :, 40], present[:, :, 40], atol=1e-5)
    alone = tmp_path / "model.onnx"
    shutil.copy(path, alone)
    shutil.copy(path.with_name("model.onnx.data"), tmp_path / "model.onnx.data")
    assert not target(str(alone)).shared
