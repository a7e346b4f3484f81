"""tools/bench_quantize_memory.py: quantize's peak memory beside the float model's bytes, from
a sampler process, with the command in its output."""

from __future__ import annotations

import json

from tests.paths import ROOT


def test_the_peak_is_sampled_and_said_beside_the_models_bytes(tmp_path, capsys):
    from tools.bench_quantize_memory import main

    model = ROOT / "tests" / "fixtures" / "trained" / "llama-onnx" / "model.onnx"
    record = tmp_path / "memory.json"
    assert main([str(model), "--no-sensitivity", "--json", str(record)]) == 0
    said = json.loads(record.read_text())
    assert said["model_bytes"] == model.stat().st_size
    # the float model is held while it is quantized and measured: more than its own bytes
    assert said["peak_anon"] > said["model_bytes"] and said["peak_rss"] >= said["peak_anon"]
    assert said["written"] and said["seconds"] > 0
    out = capsys.readouterr().out
    assert "`python -m tools.bench_quantize_memory" in out and "/ model" in out
