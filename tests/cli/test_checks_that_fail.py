"""Checks that cannot pass while checking nothing (issue 23): golden files from another model
or with other outputs, fuse --strict, internal errors, errors under --json. Driven through
the real entry point."""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.config import MhaConfig
from mha_onnx.rewrite.policy import FormPolicy
from tests.paths import OPTIMUM

CFG = MhaConfig(d_model=32, num_heads=4, mask="causal", name="c")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def golden(export_cache, tmp_path):
    source = export_cache(CFG)
    path = tmp_path / "golden.npz"
    assert cli("validate", source, "--save-outputs", path).exit_code == 0
    return source, path


def test_golden_from_another_model_is_said_and_strict_fails_it(golden, tmp_path):
    source, path = golden
    fused = tmp_path / "fused.onnx"
    assert cli("fuse", source, "-o", fused).exit_code == 0
    result = cli("validate", fused, "--load-outputs", path, "--json")
    report = json.loads(result.output)
    assert result.exit_code == 0
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["golden model"]["passed"] and "another model" in checks["golden model"]["detail"]
    assert checks["golden outputs"]["passed"]
    strict = cli("validate", fused, "--load-outputs", path, "--strict", "--json")
    assert strict.exit_code == 1
    assert not {c["name"]: c for c in json.loads(strict.output)["checks"]}["golden model"]["passed"]
    same = json.loads(cli("validate", source, "--load-outputs", path, "--strict", "--json").output)
    assert {c["name"]: c for c in same["checks"]}["golden model"]["passed"]


def test_a_golden_file_whose_outputs_the_model_lacks_compares_nothing_and_fails(golden,
                                                                                 tmp_path):
    source, path = golden
    model = onnx.load(source)
    old = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = ["renamed" if o == old else o for o in node.output]
    model.graph.output[0].name = "renamed"
    other = tmp_path / "renamed.onnx"
    onnx.save(model, other)
    result = cli("validate", other, "--load-outputs", path, "--json")
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert not checks["golden outputs"]["passed"]
    assert "0 of 1 outputs compared" in checks["golden outputs"]["detail"]


def _probs_returned() -> onnx.ModelProto:
    """Attention whose probabilities are also an output of the model: a block left as it is
    (its Softmax result is needed)."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    inputs = [helper.make_tensor_value_info(n, f, ["B", 2, "S", 8]) for n in "qkv"]
    outputs = [helper.make_tensor_value_info("o", f, ["B", 2, "S", 8]),
               helper.make_tensor_value_info("p", f, ["B", 2, "S", "S"])]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.models
def test_fuse_strict_exits_1_and_writes_nothing_when_a_block_is_left(tmp_path):
    source = tmp_path / "left.onnx"
    onnx.save(_probs_returned(), source)
    loose = cli("fuse", source, "-o", tmp_path / "fused.onnx", "--json")
    assert loose.exit_code == 0 and json.loads(loose.output)["left"] == 1
    strict = cli("fuse", source, "-o", tmp_path / "strict.onnx", "--strict", "--json")
    assert strict.exit_code == 1
    error = json.loads(strict.output)
    assert error["kind"] == "BlocksLeft" and "1 of 1 attention block(s) left" in error["error"]
    assert not (tmp_path / "strict.onnx").exists()


def test_a_bug_is_exit_4_internal_error_and_a_json_object(export_cache, monkeypatch):
    """A bug has an exit code of its own (not 1, which says outputs differ), and -v after
    the command shows its traceback too."""
    import mha_onnx.rewrite.inspect as inspect_module

    def broken(*_, **__):
        raise RuntimeError("something mha-onnx did wrong")

    monkeypatch.setattr(inspect_module, "inspect_model", broken)
    result = cli("inspect", export_cache(CFG))
    assert result.exit_code == 4
    assert "internal error: RuntimeError: something mha-onnx did wrong" in result.output
    assert "please report" in result.output
    verbose = cli("inspect", export_cache(CFG), "-v")
    assert verbose.exit_code == 4 and "Traceback" in verbose.output
    as_json = cli("inspect", export_cache(CFG), "--json")
    assert json.loads(as_json.output)["kind"] == "InternalError"


def test_errors_under_json_are_json_objects(tmp_path):
    result = cli("fuse", tmp_path / "missing.onnx", "-o", tmp_path / "x.onnx", "--json")
    assert result.exit_code == 2
    error = json.loads(result.output)
    assert error["kind"] == "ModelFileError" and "not found" in error["error"]


def test_forms_are_said_plainly(export_cache, tmp_path):
    """--form's help lists what the parser takes; a --form that matches no block is said;
    a form behind guards is one row per branch; inspect reads a fused model's blocks and
    metadata as lines, not one JSON line."""
    from mha_onnx.rewrite.policy import FORMS, KV_CACHES

    help_text = " ".join(cli("fuse", "--help").output.split())
    for kind, forms in {**FORMS, "kv_cache": KV_CACHES}.items():
        assert f"{kind}={'|'.join(forms)}" in help_text
    source = export_cache(MhaConfig(d_model=32, num_heads=4, mask="key-padding", name="kp"))
    fused = tmp_path / "fused.onnx"
    result = cli("fuse", source, "-o", fused, "--form", "causal=bias")
    assert result.exit_code == 0, result.output
    assert "--form causal=... matched no block (the model has no causal block)" in result.output
    assert max(len(line) for line in result.output.splitlines()) < 200  # branches wrapped
    assert "| If(T < 128): MHA key_padding_mask" in result.output
    inspected = cli("inspect", fused)
    assert inspected.exit_code == 0, inspected.output
    assert "fused by mha-onnx" in inspected.output and "key padding" in inspected.output
    assert "| Loop(Compress keys)" in inspected.output
    assert not any(line.strip().startswith("fusion: {") for line in inspected.output.splitlines())


def test_a_fused_graph_ort_cannot_run_is_a_fuse_bug_not_bad_input():
    """verify() running a fused graph that ORT refuses: exit 4, 'please report' (fuse's
    bug), never exit 2 (the user's input) nor 1 (outputs that differ)."""
    from onnx import TensorProto, helper

    from mha_onnx.errors import EXIT_INTERNAL, FuseBug
    from mha_onnx.rewrite.check.verify import verify

    f = TensorProto.FLOAT
    x = helper.make_tensor_value_info("x", f, ["B", 4])
    y = helper.make_tensor_value_info("y", f, ["B", 4])
    original = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])],
                                                   "g", [x], [y]),
                                 opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, 5])  # 15 elements: never
    broken = helper.make_model(helper.make_graph([helper.make_node("Reshape", ["x", "shape"],
                                                                   ["y"])], "g", [x], [y],
                                                 initializer=[shape]),
                               opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    with pytest.raises(FuseBug, match="the fused graph does not run") as caught:
        verify(original, broken)
    assert caught.value.exit_code == EXIT_INTERNAL and "report" in caught.value.hint


def test_a_failure_while_reading_a_block_leaves_the_block_not_the_run(export_cache, tmp_path,
                                                                     monkeypatch):
    import mha_onnx.rewrite.recognise.core as core

    def broken(*_, **__):
        raise ValueError("negative dimensions are not allowed")

    monkeypatch.setattr(core, "parse_softmax_attention", broken)
    result = cli("fuse", export_cache(CFG), "-o", tmp_path / "f.onnx", "--json")
    assert result.exit_code == 0, result.output
    (block,) = json.loads(result.output)["blocks"]
    assert block["status"] == "left"
    assert "failed reading this block (ValueError: negative dimensions" in block["reason"]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.models
def test_target_onnx_of_a_grouped_padded_decoder_loads_and_verifies(name, tmp_path):
    """--target onnx on causal + padding + grouped K/V (an Optimum Llama/Qwen2 with its KV
    cache): the fully-masked-row fix-up used V's G heads against the output's H heads, and
    the written file did not load in ORT."""

    from mha_onnx.rewrite import fuse_file
    from mha_onnx.runtime.ort import OrtRunner

    source = OPTIMUM / name / "model.onnx"
    report = fuse_file(source, tmp_path / "onnx.onnx", policy=FormPolicy(target="onnx"))
    assert report.fused == len(report.blocks) and report.verification.passed
    with OrtRunner(tmp_path / "onnx.onnx") as runner:
        assert runner.input_names
