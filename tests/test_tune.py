"""`fuse --tune`: the choice logic on synthetic timing tables, the dispatching model, and one
real short tune on this machine."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from mha_onnx.cli import main
from mha_onnx.runtimes import OrtRunner
from mha_onnx.tune import ORIGINAL, Rule, choose, dispatch
from tests.conftest import SMALL


def test_each_length_takes_the_candidate_whose_worst_batch_is_best():
    table = {  # (batch, length) -> ms
        (1, 16): {ORIGINAL: 1.0, "a": 0.95, "b": 0.9},
        (8, 16): {ORIGINAL: 8.0, "a": 7.0, "b": 9.0},   # b loses at batch 8: a is safer
        (1, 256): {ORIGINAL: 10.0, "a": 6.0, "b": 5.0},
        (8, 256): {ORIGINAL: 80.0, "a": 50.0, "b": 40.0},
        (1, 4096): {ORIGINAL: 100.0, "a": 60.0, "b": 50.0},
    }
    assert choose(table) == [Rule(64, "a"), Rule(None, "b")]  # sqrt(16 * 256) = 64


def test_the_original_wins_where_nothing_beats_it_and_ties_go_to_it():
    table = {(1, 16): {ORIGINAL: 1.0, "a": 1.2}, (1, 64): {ORIGINAL: 2.0, "a": 2.0},
             (1, 256): {ORIGINAL: 9.0, "a": 3.0}}
    assert choose(table) == [Rule(128, ORIGINAL), Rule(None, "a")]
    assert choose({(1, 16): {ORIGINAL: 1.0, "a": 0.5}}) == [Rule(None, "a")]


def test_noise_sized_gains_keep_the_original_and_the_default_fusion_is_preferred():
    table = {(1, 16): {ORIGINAL: 1.0, "fused": 0.99, "a": 0.98},   # 2 %: noise, keep original
             (1, 64): {ORIGINAL: 1.0, "fused": 0.90, "a": 0.88},   # a within 3 % of fused
             (1, 256): {ORIGINAL: 1.0, "fused": 0.80, "a": 0.60}}  # a clearly ahead
    assert choose(table) == [Rule(32, ORIGINAL), Rule(128, "fused"), Rule(None, "a")]


def _scaled(factor: float) -> onnx.ModelProto:
    """y = x * w (w shared by name across candidates), then * factor."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["t"]),
         helper.make_node("Mul", ["t", "f"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
        [w, helper.make_tensor("f", TensorProto.FLOAT, [], [factor])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_the_dispatching_model_runs_each_rules_candidate_and_shares_weights():
    models = {ORIGINAL: _scaled(1.0), "two": _scaled(2.0), "three": _scaled(3.0)}
    tuned = dispatch(models, [Rule(8, "two"), Rule(32, ORIGINAL), Rule(None, "three")], "seq")
    onnx.checker.check_model(tuned)
    assert sum(i.name == "w" for i in tuned.graph.initializer) == 1  # stored once
    with OrtRunner(tuned.SerializeToString()) as run:
        for seq, factor in ((4, 2.0), (8, 1.0), (31, 1.0), (32, 3.0), (100, 3.0)):
            x = np.ones((2, seq, 4), np.float32)
            np.testing.assert_allclose(run.infer({"x": x})["y"], x * [1, 2, 3, 4] * factor)


def test_a_real_short_tune(export_cache, tmp_path):
    """Seconds: two lengths, one batch; the tuned model is verified, carries its table and
    the machine, validate passes against PyTorch, and re-tuning it is refused."""
    src = export_cache(SMALL.replace(mask="key-padding"))
    out = tmp_path / "tuned.onnx"
    result = CliRunner().invoke(main, ["fuse", str(src), "-o", str(out), "--tune", "--tune-batch",
                                       "1", "--tune-seq-lens", "16,128", "--tune-threads", "1",
                                       "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert set(report["tuning"]["table_ms"]) == {"1x16", "1x128"}
    assert ORIGINAL in report["tuning"]["table_ms"]["1x16"]
    assert report["tuning"]["machine"]["onnxruntime"]
    from mha_onnx import metadata
    from mha_onnx.parity import ValidateConfig, validate_model

    tuned = onnx.load(out)
    assert metadata.loaded(tuned, "tuning")["runs"] == report["rules"]
    assert validate_model(out, ValidateConfig())
    again = CliRunner().invoke(main, ["tune", str(out), "-o", str(tmp_path / "again.onnx")])
    assert again.exit_code == 2 and "already tuned" in again.output


@pytest.mark.parametrize("extra", [["--tune-batch", "0"], ["--tune-seq-lens", "x"]])
def test_bad_grids_are_refused(tmp_path, extra):
    path = tmp_path / "m.onnx"
    onnx.save(_scaled(1.0), path)
    result = CliRunner().invoke(main, ["tune", str(path), "-o", str(tmp_path / "o.onnx"), *extra])
    assert result.exit_code == 2, result.output


@pytest.mark.parametrize("extra", [["--target", "onnx"], ["--ep", "cuda"],
                                   ["--form", "causal=bias"], ["--kv-cache", "shared"]])
def test_tune_refuses_options_it_would_ignore(tmp_path, extra):
    path = tmp_path / "m.onnx"
    onnx.save(_scaled(1.0), path)
    result = CliRunner().invoke(main, ["fuse", str(path), "-o", str(tmp_path / "o.onnx"),
                                       "--tune", *extra])
    assert result.exit_code == 2 and "--tune chooses the forms itself" in result.output
    assert not (tmp_path / "o.onnx").exists()
