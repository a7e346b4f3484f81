from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.config import MhaConfig
from mha_onnx.errors import EXIT_MISMATCH, EXIT_OK, EXIT_PROVIDER, InputSpecError
from mha_onnx.graph.inputs import input_specs, parse_shapes
from mha_onnx.parity import ValidateConfig, parse_tolerances, validate_model
from mha_onnx.rewrite import fuse_file
from mha_onnx.runtime.ort import cuda_available

CFG = MhaConfig(d_model=32, num_heads=4, name="t", mask="key-padding")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, export_cache):
    """(unfused export, fused model) with key padding."""
    folder = tmp_path_factory.mktemp("parity")
    original = export_cache(CFG)
    fused = folder / "fused.onnx"
    fuse_file(original, fused)
    return original, fused


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_fused_passes_against_original_and_pytorch(pair):
    original, fused = pair
    report = validate_model(fused, ValidateConfig(reference=str(original)))
    assert report.exit_code == EXIT_OK, report.render()
    against = {c.against for c in report.comparisons}
    assert against == {"pytorch", "reference"}
    cases = {c.case.split(" (")[0] for c in report.comparisons}
    assert {"seq 1", "odd", "pow2", "odd, padded", "pow2, long"} <= cases
    # fully padded batch entries are reported apart, with each runtime's behaviour
    assert report.masked_rows
    assert set(report.masked_rows[0].behaviour.values()) == {"NaN"}
    stats = report.comparisons[0].stats.to_dict()
    for key in ("max_abs", "max_rel", "mean_abs", "p99_abs", "mismatch_fraction", "cosine",
                "nan_actual", "inf_actual"):
        assert key in stats


def test_unfused_export_alone_uses_its_metadata(pair):
    report = validate_model(pair[0], ValidateConfig())
    assert report and {c.against for c in report.comparisons} == {"pytorch"}


def _perturbed(src, dst, delta=1e-2):
    model = onnx.load(src)
    meta = json.loads({p.key: p.value for p in model.metadata_props}["mha_onnx.params"])
    name = meta["w_o.weight"]["initializer"]
    for tensor in model.graph.initializer:
        if tensor.name == name:
            array = onnx.numpy_helper.to_array(tensor).copy()
            array.flat[0] += delta
            tensor.CopyFrom(onnx.numpy_helper.from_array(array, name))
    onnx.save(model, dst)


def test_perturbed_weight_fails_naming_output_and_error(pair, tmp_path):
    original, fused = pair
    bad = tmp_path / "bad.onnx"
    _perturbed(fused, bad)
    result = cli("validate", bad, "--reference", original)
    assert result.exit_code == EXIT_MISMATCH
    assert "FAIL output on cpu" in result.output and "max abs error" in result.output
    steps = [line for line in result.stderr.splitlines() if line.startswith("[validate] ")]
    assert "input shapes on cpu against" in steps[0] and "shape 1/" in steps[1], steps
    # without the original, the export's checksum still catches it
    result = cli("validate", bad, "--json")
    data = json.loads(result.output)
    assert result.exit_code == EXIT_MISMATCH
    assert [c for c in data["checks"] if c["name"] == "weights"][0]["passed"] is False


@pytest.mark.skipif(cuda_available()[0], reason="this machine has a working CUDA EP")
def test_cuda_missing_is_never_a_pass(pair):
    original, fused = pair
    result = cli("validate", fused, "--providers", "cpu,cuda", "--json")
    data = json.loads(result.output)
    assert result.exit_code == EXIT_PROVIDER
    cuda = [p for p in data["providers"] if p["provider"] == "cuda"][0]
    assert not cuda["ran"] and cuda["reason"]
    assert all(c["provider"] == "cpu" for c in data["comparisons"])
    result = cli("validate", fused, "--providers", "cuda", "--allow-missing")
    assert result.exit_code == EXIT_OK and "MISSING (allowed)" in result.output


def test_shapes_and_tolerances(pair):
    specs = input_specs(onnx.load(pair[0]))
    cases = parse_shapes("1:5,3:17", specs)
    assert [c.dims for c in cases] == [{"batch": 1, "seq_q": 5}, {"batch": 3, "seq_q": 17}]
    tol = parse_tolerances(["1e-3", "output=5e-2"], ["out2=0.1"])
    assert tol["*"].atol == 1e-3 and tol["output"].atol == 5e-2 and tol["out2"].rtol == 0.1
    cfg = ValidateConfig(tolerances=tol)
    assert cfg.tolerance_for("output", np.dtype(np.float32)) == (5e-2, 1e-5)
    assert cfg.tolerance_for("other", np.dtype(np.float16)) == (1e-3, 1e-2)
    for bad in ("1:", "a:b", "0:4", "1:2:3:4"):
        with pytest.raises(InputSpecError):
            parse_shapes(bad, specs)
    with pytest.raises(InputSpecError):
        parse_tolerances(["x=abc"], [])
    report = validate_model(pair[1], ValidateConfig(shapes=tuple(cases), reference=str(pair[0])))
    assert {c.case for c in report.comparisons} == {c.describe() for c in cases}


def test_float32_bounds_grow_with_the_outputs_scale():
    """Logits in the hundreds (a random model with wide weights) differ by float32 rounding
    alone by more than 1e-4: export --model refused such a model ("would need atol
    0.000147 ... please report this model"); the default bound is relative too now."""
    from mha_onnx.stats import compare

    want = np.linspace(-300, 300, 1001).astype(np.float32)
    got = want * np.float32(1 + 2e-6)  # (float32 rounding at this scale)
    assert compare(got, want).passed
    assert not compare(want + np.float32(1e-3), want).passed  # (a real error still fails)


def test_tight_tolerance_fails_and_says_what_was_needed(pair):
    result = cli("validate", pair[1], "--reference", pair[0], "--atol", "0", "--shapes", "2:9")
    assert result.exit_code == EXIT_MISMATCH
    assert "would need atol" in result.output


def test_model_without_metadata_needs_a_reference(tmp_path, pair):
    model = onnx.load(pair[0])
    del model.metadata_props[:]
    onnx.save(model, tmp_path / "plain.onnx")
    result = cli("validate", tmp_path / "plain.onnx")
    assert result.exit_code == 2 and "--reference" in result.output
    assert cli("validate", tmp_path / "plain.onnx", "--reference", pair[0]).exit_code == EXIT_OK


def test_unknown_provider_is_a_usage_error(pair):
    result = cli("validate", pair[1], "--providers", "cpu,tpu")
    assert result.exit_code == 2 and "unknown execution provider 'tpu'" in result.output


def test_a_decoders_padded_positions_are_left_out_also_after_a_past():
    """What a KV-cache decoder computes at a position its mask pads is never read, and
    runtimes differ there (a padded query whose sliding window holds only padding: Gemma 3
    with a window of 8 failed `export --model` at 16 new tokens after 32): the logits of the
    new tokens are blanked at the mask's last columns, a present's along all of them, every
    kept position left as it was."""
    from mha_onnx.graph.inputs import InputSpec
    from mha_onnx.parity.decode import blank_padded

    specs = [InputSpec("input_ids", np.dtype(np.int64), ("batch", "sequence_length"), "ids"),
             InputSpec("attention_mask", np.dtype(np.int64), ("batch", "total"), "mask")]
    out_dims = {"logits": ["batch", "sequence_length", 5],
                "present.0.key": ["batch", 2, "total", 4]}
    mask = np.ones((2, 7), np.int64)
    mask[1, 4:] = 0  # row 1: its three new tokens (after a past of 4) padded
    mask[0, 0] = 0  # row 0: its first past position padded
    rng = np.random.default_rng(0)
    outputs = {"logits": rng.standard_normal((2, 3, 5)).astype(np.float32),  # 3 new after 4
               "present.0.key": rng.standard_normal((2, 2, 7, 4)).astype(np.float32)}
    got = blank_padded(outputs, {"attention_mask": mask}, specs, out_dims, {"present.0.key"})
    new = mask[:, 4:] != 0
    for b in range(2):
        for t in range(3):
            want = outputs["logits"][b, t] if new[b, t] else 0
            np.testing.assert_array_equal(got["logits"][b, t], want)
        for t in range(7):
            want = outputs["present.0.key"][b, :, t] if mask[b, t] else 0
            np.testing.assert_array_equal(got["present.0.key"][b, :, t], want)
    assert (got["logits"] == 0).sum() == 3 * 5 and (got["present.0.key"] == 0).sum() == 4 * 2 * 4
    same = blank_padded(outputs, {"attention_mask": np.ones((2, 7), np.int64)}, specs, out_dims,
                        {"present.0.key"})
    assert all(same[k] is outputs[k] for k in outputs)  # nothing padded: nothing changed


def _learned_positions(path, rows: int) -> None:
    """input_ids -> token table + position table[rows] gathered by Range(0, seq): a file
    made elsewhere (no export --model record of its table)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    tables = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
              for name, shape in (("wte", (100, 8)), ("wpe", (rows, 8)))]
    scalars = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", 0),
                                                                                 ("one", 1))]
    nodes = [helper.make_node("Gather", ["wte", "input_ids"], ["tokens"]),
             helper.make_node("Shape", ["input_ids"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["seq"]),
             helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
             helper.make_node("Gather", ["wpe", "positions"], ["learned"]),
             helper.make_node("Add", ["tokens", "learned"], ["out"])]
    graph = helper.make_graph(
        nodes, "positions",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq", 8])],
        tables + scalars)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, path)


def test_the_default_sweep_stays_inside_a_position_table_of_a_file_made_elsewhere(tmp_path):
    """A learned position table of 64 rows in a file export did not write: the sweep's
    lengths stop at half of it (past and new together may not pass it), where its 128-token
    case failed in ORT (exit 2) before."""
    path = tmp_path / "positions.onnx"
    _learned_positions(path, 64)
    report = validate_model(path, ValidateConfig(reference=str(path)))
    assert report.exit_code == EXIT_OK, report.render()
    assert len({c.case for c in report.comparisons}) == 5
    result = cli("validate", path, "--reference", path, "--json")
    assert result.exit_code == EXIT_OK, result.output


@pytest.mark.models
def test_a_shared_cache_reference_runs_behind_the_appended_interface_as_the_model(tmp_path):
    """`validate A --reference B` with B a shared-cache fusion (itself, or the same model
    fused another way): B's buffers are set up and its presents cut to the run's length as
    A's are. Before, B ran bare and the first present's shapes differed: internal error."""
    from mha_onnx.rewrite.policy import FormPolicy
    from tests.paths import OPTIMUM

    made = {}
    for form in ("shared", "appended"):
        made[form] = tmp_path / form / "model.onnx"
        fuse_file(OPTIMUM / "llama" / "model.onnx", made[form], policy=FormPolicy(kv_cache=form))
    for model, reference in (("shared", "shared"), ("appended", "shared")):
        report = validate_model(made[model], ValidateConfig(reference=str(made[reference])))
        assert report.exit_code == EXIT_OK, (model, reference, report.render())
        assert any(c.against == "reference" and c.output.startswith("present.")
                   for c in report.comparisons)


def _masked_fill_attention(path, zero_masked_rows: bool) -> None:
    """Self-attention over x [B, T, 8] with ``Where(mask == 0, -1e9, scores)``: a query whose
    keys are all masked averages the values. ``zero_masked_rows``: a file that gives zeros
    there instead and equals it everywhere else."""
    from onnx import TensorProto, helper

    f, i = TensorProto.FLOAT, TensorProto.INT64
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "xt"], ["scores"]),
             helper.make_node("Unsqueeze", ["attention_mask", "one"], ["mask3"]),
             helper.make_node("Equal", ["mask3", "zero"], ["masked"]),
             helper.make_node("Where", ["masked", "fill", "scores"], ["filled"]),
             helper.make_node("Softmax", ["filled"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["probs", "x"], ["out" if not zero_masked_rows else "o"])]
    if zero_masked_rows:
        nodes += [helper.make_node("ReduceMax", ["attention_mask", "one"], ["kept"], keepdims=1),
                  helper.make_node("Unsqueeze", ["kept", "one"], ["kept3"]),
                  helper.make_node("Cast", ["kept3"], ["keep"], to=f),
                  helper.make_node("Mul", ["o", "keep"], ["out"])]
    inits = [helper.make_tensor("one", i, [1], [1]), helper.make_tensor("zero", i, [], [0]),
             helper.make_tensor("fill", f, [], [-1e9])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["B", "T", 8]),
                                           helper.make_tensor_value_info("attention_mask", i,
                                                                         ["B", "T"])],
                              [helper.make_tensor_value_info("out", f, ["B", "T", 8])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                ir_version=9), path)


def test_fully_masked_rows_are_compared_against_the_original(tmp_path):
    """Against an ONNX reference (the original's own graph) a fully masked row counts as any
    other: a file that gives zeros where the original averages V fails, and says the rows
    were compared; the original against itself passes."""
    original, zeroed = tmp_path / "original.onnx", tmp_path / "zeroed.onnx"
    _masked_fill_attention(original, False)
    _masked_fill_attention(zeroed, True)
    same = validate_model(original, ValidateConfig(reference=str(original)))
    assert same.exit_code == EXIT_OK, same.render()
    assert same.masked_rows and all(m.compared == ("reference",) for m in same.masked_rows)
    assert "compared with reference as every row" in same.render()
    differs = validate_model(zeroed, ValidateConfig(reference=str(original)))
    assert differs.exit_code == EXIT_MISMATCH, differs.render()
    failed = {c.case for c in differs.failures()}
    assert failed and failed == {m.case for m in differs.masked_rows}, failed
