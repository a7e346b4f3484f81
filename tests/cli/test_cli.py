from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from mha_onnx.cli import main


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.mark.slow
def test_export_and_inspect(cli, tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("d_model = 32\nnum_heads = 4\n")
    out = tmp_path / "m.onnx"
    result = cli("export", "--config", cfg, "--mask", "causal", "-o", out)
    assert result.exit_code == 0, result.output
    assert "exported" in result.output and "parity" in result.output
    result = cli("export", "--config", cfg, "-o", out, "--json")
    assert result.exit_code != 0 and "output exists" in result.output
    result = cli("export", "--config", cfg, "--attention", "cross", "-o", out, "--force", "--json")
    data = json.loads(result.output)
    assert result.exit_code == 0 and [i["name"] for i in data["inputs"]] == ["query", "key", "value"]
    names = [c["name"] for c in data["checks"] if c["passed"]]
    assert {"onnx.checker", "ort_load"} <= set(names) and any(n.startswith("parity") for n in names)

    result = cli("inspect", out, "--json")
    assert result.exit_code == 0
    summary = json.loads(result.output)
    assert summary["attention_blocks"]["unfused"] == 1
    assert summary["metadata"]["config"]["attention"] == "cross"
    assert summary["parameter_count"] == 4 * 32 * 32 + 4 * 32
    assert [d for d in summary["inputs"][1]["dims"]] == ["batch", "seq_kv", 32]
    text = cli("inspect", out).output
    assert "1 unfused" in text and "seq_kv" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["export", "--preset", "huge", "-o", "{tmp}/x.onnx"], "unknown preset 'huge'"),
        (["export", "--config", "{tmp}/none.toml", "-o", "{tmp}/x.onnx"], "config file not found"),
        (["export", "--weights", "{tmp}/none.pt", "-o", "{tmp}/x.onnx"], "weights file not found"),
        (["export", "--opset", "9", "-o", "{tmp}/x.onnx"], "opset 9 is not supported"),
        (["inspect", "{tmp}/none.onnx"], "model not found"),
        (["inspect", "{tmp}"], "is a folder"),
        (["inspect", "{tmp}/garbage.onnx"], "not a valid ONNX model"),
    ],
    ids=["preset", "config", "weights", "opset", "missing", "folder", "garbage"],
)
def test_bad_input_one_line_no_traceback(cli, tmp_path, args, message):
    (tmp_path / "garbage.onnx").write_bytes(b"\x08\x07garbage\xff\xff")
    result = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "x.onnx").exists()


def test_help_imports_nothing_heavy():
    done = subprocess.run([sys.executable, "-m", "mha_onnx.cli", "--help"], capture_output=True,
                          text=True, check=True)
    assert "export" in done.stdout
    code = "import sys, mha_onnx.cli; print('torch' in sys.modules, 'onnxruntime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
