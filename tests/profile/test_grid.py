"""A grid of points timed in one child process (profile.worker.grid_in_child): results in
order as they end, each model's session made once, a crash of that child isolated."""

from __future__ import annotations

import sys

import onnx
from onnx import TensorProto, helper

from mha_onnx.profile import worker
from mha_onnx.profile.worker import PointSpec, grid_in_child, measure_grid


def _model(path) -> str:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                ir_version=10), path)
    return str(path)


def _specs(tmp_path, lengths=(32, 8, 16)) -> list[PointSpec]:
    models = (_model(tmp_path / "a.onnx"), _model(tmp_path / "b.onnx"))
    return [PointSpec(models=models, seq_len=n, warmup=1, iters=2, min_time=None)
            for n in lengths]


def test_a_grid_makes_each_session_once_and_times_every_point(tmp_path, monkeypatch):
    made = []
    real = worker._runner
    monkeypatch.setattr(worker, "_runner", lambda spec, model: made.append(model) or
                        real(spec, model))
    results = list(measure_grid(_specs(tmp_path)))
    assert len(made) == 2  # two models, three points
    assert all(len(r["models"][m]["times"]) == 2 for r in results for m in r["models"])


def test_a_grid_in_a_child_reports_each_point_by_its_index(tmp_path):
    seen = {}
    grid_in_child(_specs(tmp_path), lambda n, raw: seen.__setitem__(n, raw))
    assert sorted(seen) == [0, 1, 2]
    assert all("error" not in raw and len(raw["models"]) == 2 for raw in seen.values())


def test_a_crash_is_the_error_of_its_point_and_the_rest_are_timed_alone(tmp_path,
                                                                        monkeypatch):
    """The grid's child ends by a signal after its first point: that point came back, the
    next is the crash's error, the last is timed in a child of its own."""
    fake = tmp_path / "crashing_python"
    fake.write_text(f"""#!{sys.executable}
import json, os, signal, subprocess, sys
data = sys.stdin.read()
if '"points"' not in data:  # one point: the real child
    sys.exit(subprocess.run([{sys.executable!r}, *sys.argv[1:]], input=data, text=True).returncode)
print(json.dumps({{"index": 0, "result": {{"models": {{}}, "first": True}}}}), flush=True)
os.kill(os.getpid(), signal.SIGSEGV)
""")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    seen = {}
    grid_in_child(_specs(tmp_path), lambda n, raw: seen.__setitem__(n, raw))
    assert seen[0].get("first") and "crashed (SIGSEGV)" in seen[1]["error"]
    assert len(seen[2]["models"]) == 2 and "error" not in seen[2]
