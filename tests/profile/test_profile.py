from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.config import MhaConfig
from mha_onnx.errors import ConfigError, ResourceError
from mha_onnx.profile import ProfileConfig, attention_flops, check_memory, profile_models
from mha_onnx.profile.memory import estimate_bytes
from mha_onnx.rewrite import fuse_model
from tests.paths import OPTIMUM

CFG = MhaConfig(d_model=32, num_heads=4, name="p")


def test_flops_are_counted_honestly():
    cfg = MhaConfig(d_model=8, num_heads=2)  # d_k = d_v = 4
    proj = 2 * 1 * (3 * 8 * 8 * 3 + 3 * 8 * 8)  # q, k, v and output projections, S = T = 3
    assert attention_flops(cfg, 1, 3, 3) == proj + 2 * 2 * 9 * 8
    causal = attention_flops(cfg.replace(mask="causal"), 1, 3, 3)
    assert causal == proj + 2 * 2 * 6 * 8  # 1 + 2 + 3 attended pairs
    assert attention_flops(cfg, 1, 3, 3, kept=2) == proj + 2 * 2 * 6 * 8
    from mha_onnx.profile.flops import kernel_flops

    for quantized in ("MatMulNBits", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"):
        assert kernel_flops(quantized, [[2, 3, 64]], [[2, 3, 16]]) == 2 * 96 * 64, quantized


def test_profile_points_and_comparison(export_cache, tmp_path):
    from mha_onnx.rewrite import fuse_file

    unfused = export_cache(CFG)
    fused = tmp_path / "fused.onnx"
    fuse_file(unfused, fused)
    config = ProfileConfig(seq_lens=(8, 33), batches=(1, 2), iters=3, min_time=None, warmup=1, threads=1,
                           trace_dir=str(tmp_path / "traces"))
    seen = []
    report = profile_models([unfused, fused], config, on_point=lambda d, t, label: seen.append(d))
    assert report and len(report.points) == 8 and seen[-1] == 8
    for p in report.points:
        assert p.iters == 3 and 0 < p.min_ms <= p.p50_ms <= p.p90_ms <= p.p99_ms
        assert p.tokens_per_s > 0 and p.gflops > 0 and p.roofline_fraction > 0
        assert p.peak_rss_bytes > p.run_rss_bytes >= 0
        assert p.memory == p.peak_rss_bytes  # the column: the peak, not the runs' growth
        assert p.top_ops and abs(sum(o.share for o in p.top_ops) - 1) < 0.2
        assert p.trace and (tmp_path / "traces").is_dir()
    assert {o.op_type for p in report.points if p.model == str(fused) for o in p.top_ops} >= {
        "MultiHeadAttention"}
    assert "peak mem" in report.render() and " 0 B " not in report.render()
    speed = report.speedups()
    assert len(speed) == 4 and all(s["speedup"] > 0 for s in speed)
    assert "cpu float32" in report.roofline_gflops and report.roofline_gflops["cpu float32"] > 0


def test_cli_json_csv_plot(export_cache, tmp_path):
    path = export_cache(CFG)
    result = CliRunner().invoke(main, ["profile", str(path), "--seq-lens", "16,32", "--iters", "2",
                                       "--json", "--csv", str(tmp_path / "p.csv"),
                                       "--plot", str(tmp_path / "p.png"), "--no-ops"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert [p["seq_len"] for p in data["points"]] == [16, 32]
    assert all(p["p50_ms"] > 0 for p in data["points"])
    assert (tmp_path / "p.csv").read_text().count("\n") == 3
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--seq-lens", "12,x"], "malformed --seq-lens"),
    (["--seq-lens", "0"], "positive integers"),
    (["--batch", "-1"], "positive integers"),
    (["--providers", "gpu"], "unknown execution provider"),
])
def test_bad_options(export_cache, args, message):
    result = CliRunner().invoke(main, ["profile", str(export_cache(CFG)), *args])
    assert result.exit_code == 2 and message in result.output


def test_memory_estimate_refuses_huge_unfused_points(export_cache):
    path = str(export_cache(CFG))
    unfused = onnx.load(path)
    fused, _, _ = fuse_model(unfused)
    assert estimate_bytes(unfused, 1, 1024) > estimate_bytes(fused, 1, 1024) > 0
    with pytest.raises(ResourceError, match="needs about"):
        check_memory([path], ProfileConfig(seq_lens=(2_000_000,)))
    check_memory([path], ProfileConfig(seq_lens=(2_000_000,), memory_check=False))
    with pytest.raises(ConfigError):
        ProfileConfig(pad_fraction=1.5)


def test_interleaved_points_and_thread_counts(export_cache, tmp_path):
    """Interleaved: both models timed in one process (no memory figures); two thread counts:
    a point each, and the best one named."""
    from mha_onnx.rewrite import fuse_file

    unfused = export_cache(CFG)
    fused = tmp_path / "fused.onnx"
    fuse_file(unfused, fused)
    config = ProfileConfig(seq_lens=(16,), iters=3, min_time=None, warmup=1, threads=(1, 2),
                           interleave=True, op_breakdown=False)
    report = profile_models([unfused, fused], config)
    assert report and report.interleaved and len(report.points) == 4
    assert {p.threads for p in report.points} == {1, 2}
    assert all(p.memory is None and p.iters == 3 for p in report.points)
    best = report.best_threads()
    assert len(best) == 2 and all(b["threads"] in (1, 2) for b in best)
    data = report.to_dict()
    assert data["schema"] >= 2 and data["machine"]["cpus"] and data["best_threads"] == best
    assert "best threads" in report.render()


@pytest.mark.parametrize("option", ["--csv", "--plot", "--trace"])
def test_outputs_are_not_replaced_without_force(export_cache, tmp_path, option):
    target = tmp_path / ("traces" if option == "--trace" else "out.file")
    if option == "--trace":
        target.mkdir()
        (target / "old.json").write_text("{}")
    else:
        target.write_text("keep me")
    args = ["profile", str(export_cache(CFG)), "--seq-lens", "8", "--iters", "1", "--no-ops",
            option, str(target)]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 2 and ("exists" in refused.output or "not empty" in refused.output)
    if option != "--trace":
        assert target.read_text() == "keep me"
    replaced = CliRunner().invoke(main, [*args, "--force"])
    assert replaced.exit_code == 0, replaced.output
    if option != "--trace":
        assert target.read_bytes() != b"keep me"


def test_speedups_read_as_faster_or_slower_and_broken_rooflines_are_flagged():
    from mha_onnx.profile.report import _fraction, speed_words

    assert speed_words(1.16) == "1.16x faster" and speed_words(1 / 1.16) == "1.16x slower"
    assert _fraction(0.42) == "42%" and _fraction(1.31) == ">100%?" and _fraction(None) == "-"


@pytest.mark.timing
def test_a_failed_point_is_an_error_row_null_figures_and_exit_1(tmp_path):
    """A graph that adds a [1, 64] table to its [B, S] input runs at S = 64 only."""
    import json

    import numpy as np
    from click.testing import CliRunner
    from onnx import TensorProto, helper, numpy_helper

    from mha_onnx.cli import main

    table = numpy_helper.from_array(np.ones((1, 64), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "table"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
        initializer=[table])
    path = tmp_path / "fixed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                ir_version=9), path)
    args = ["profile", str(path), "--seq-lens", "64,100,64", "--iters", "2", "--no-ops",
            "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    points = json.loads(result.output[result.output.index("{"):])["points"]
    assert [p["seq_len"] for p in points] == [64, 100]  # stopped at the failed point
    assert points[1]["error"] and points[1]["p50_ms"] is None and points[0]["p50_ms"] > 0
    going = CliRunner().invoke(main, args + ["--keep-going"])
    assert going.exit_code == 1
    assert [p["seq_len"] for p in json.loads(going.output[going.output.index("{"):])["points"]] \
        == [64, 100, 64]


@pytest.mark.timing
def test_profile_sweeps_only_the_axes_a_model_has(tmp_path):
    """An Optimum ViT (fixed image size): batches only, no lengths or tokens/s; with
    --inputs, the one shape the inputs have (batch 2 x 40 tokens on BERT)."""
    import json

    import numpy as np
    from click.testing import CliRunner

    from mha_onnx.cli import main

    fixtures = OPTIMUM

    def run(*args):
        result = CliRunner().invoke(main, ["profile", *map(str, args), "--iters", "2",
                                           "--no-ops", "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output[result.output.index("{"):])["points"]

    vit = run(fixtures / "vit" / "model.onnx", "--batch", "1,2", "--seq-lens", "128,512")
    assert [(p["batch"], p["seq_len"], p["tokens_per_s"]) for p in vit] == [(1, 0, None),
                                                                            (2, 0, None)]
    feeds = tmp_path / "in.npz"
    np.savez(feeds, input_ids=np.ones((2, 40), np.int64),
             attention_mask=np.ones((2, 40), np.int64), token_type_ids=np.zeros((2, 40), np.int64))
    bert = run(fixtures / "bert" / "model.onnx", "--inputs", feeds, "--seq-lens", "128,512")
    assert [(p["batch"], p["seq_len"]) for p in bert] == [(2, 40)]
    assert bert[0]["tokens_per_s"] > 0


@pytest.mark.timing
def test_comparisons_interleave_by_default(tmp_path):
    import json

    from click.testing import CliRunner

    from mha_onnx.cli import main

    vit = OPTIMUM / "vit" / "model.onnx"
    args = ["profile", str(vit), str(vit), "--iters", "2", "--no-ops", "--json"]
    for extra, interleaved in (((), True), (("--no-interleave",), False)):
        result = CliRunner().invoke(main, [*args, *extra])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output[result.output.index("{"):])
        assert report["interleaved"] is interleaved
        assert all(s["speedup"] > 0 for s in report["speedups"])


def test_each_round_of_an_interleaved_timing_starts_one_model_later():
    """In a fixed order whichever runs first always follows the last one's work: the
    rounds rotate, so each callable leads as often as the others."""
    from mha_onnx.profile.worker import timed_loop

    calls: list[int] = []
    times = timed_loop([lambda n=n: calls.append(n) for n in range(3)], warmup=0, iters=3,
                       min_time=None)
    assert [len(t) for t in times] == [3, 3, 3]
    assert calls == [0, 1, 2, 1, 2, 0, 2, 0, 1]
