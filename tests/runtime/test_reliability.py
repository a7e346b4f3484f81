"""Reliability: crashes inside ONNX Runtime contained, no attention missed, files others can
read, every exit code of the README's table produced, real inputs, golden outputs."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.config import MhaConfig
from mha_onnx.graph.inputs import input_specs
from mha_onnx.graph.preflight import preflight
from tests.irgraphs import Graph, model, node, tensor

CFG = MhaConfig(d_model=32, num_heads=4, mask="key-padding", name="r")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# -- crashes inside ONNX Runtime ---------------------------------------------------------------

@pytest.fixture(scope="module")
def crashing(tmp_path_factory):
    """torch.nn.MultiheadAttention in float16 with key padding: ORT 1.31 CPU dies by SIGSEGV
    creating a session at ORT_ENABLE_ALL (its NCHWc transformer); fine at EXTENDED."""
    import torch

    from tests.models import D, TorchMha, batch_seq_dims, export

    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    module = TorchMha(True, "key_padding").half()
    proto = export(module, (torch.randn(2, 5, D).half(), None, None, torch.zeros(2, 5, dtype=torch.bool)),
                   {"query": {0: batch, 1: seq}, "key": None, "value": None,
                    "key_padding_mask": {0: batch, 1: seq}})
    path = tmp_path_factory.mktemp("crash") / "mha_fp16.onnx"
    onnx.save(proto, path)
    checked = preflight(path)
    if not checked.crashed:
        pytest.skip(f"this onnxruntime no longer crashes on the model ({checked})")
    return path


def test_a_crash_is_one_line_with_what_still_works(crashing):
    result = cli("validate", crashing, "--reference", crashing)
    assert result.exit_code == 3
    assert "crashed (SIGSEGV)" in result.output and "CPU" in result.output
    assert "ORT_ENABLE_ALL" in result.output and "runs at ORT_ENABLE_EXTENDED" in result.output
    profiled = cli("profile", crashing, "--seq-lens", "8", "--iters", "1", "--no-ops")
    assert profiled.exit_code == 3 and "runs at ORT_ENABLE_EXTENDED" in profiled.output


def test_fuse_records_the_session_options_and_validate_uses_them(crashing, tmp_path):
    fused = tmp_path / "fused.onnx"
    result = cli("fuse", crashing, "-o", fused, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["verification"]["passed"] and any("ORT_ENABLE_EXTENDED" in n for n in report["notes"])
    meta = {p.key: p.value for p in onnx.load(fused).metadata_props}
    assert json.loads(meta["mha_onnx.session"]) == {"optimization": "extended"}
    checked = cli("validate", fused, "--reference", crashing, "--shapes", "2:9")
    assert checked.exit_code == 0, checked.output


# -- no attention missed ------------------------------------------------------------------------

def test_bloom_alibi_scores_fuse_onto_gqa_with_an_attention_bias(zoo):
    """BLOOM adds ALiBi on [B*H, S, T] (baddbmm) and its causal + padding mask on
    [B, H, S, T]: the causal part is proven, ALiBi (computed from attention_mask) is added
    as GQA's attention_bias; verified over every branch (left padding takes the general one)."""
    from tests.fusing import fused_and_checked, ops

    fused, results = fused_and_checked(zoo("hf_bloom"))
    (block,) = results
    assert block.form == ("If(right padding): GroupQueryAttention (causal, bias) | "
                          "MHA + attention_bias")
    assert block.meaning == "causal + key padding + bias on merged heads (ALiBi-style)"
    assert block.details["mask_meaning"]["merged_bias"]
    assert "GroupQueryAttention" in ops(fused)


def test_every_softmax_over_two_activations_is_a_candidate(tmp_path):
    """Attention weights returned and never multiplied with V: listed, not fused, with why."""
    proto = model([node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], "s"),
                   node("Softmax", ["s"], "p", axis=-1)],
                  [tensor("q", 1, ["B", 2, "S", 8]), tensor("k", 1, ["B", 2, "S", 8])], ["p"],
                  out_types={"p": (1, ["B", 2, "S", "S"])})
    path = tmp_path / "weights.onnx"
    onnx.save(proto, path)
    result = cli("fuse", path, "-o", tmp_path / "out.onnx", "--json")
    assert result.exit_code == 0, result.output
    (block,) = json.loads(result.output)["blocks"]
    assert block["status"] == "left" and "never reach a MatMul with V" in block["reason"]


# -- files, exit codes ---------------------------------------------------------------------------

def test_outputs_honour_the_umask(export_cache, tmp_path):
    old = os.umask(0o022)
    try:
        fused, golden = tmp_path / "f.onnx", tmp_path / "g.npz"
        assert cli("fuse", export_cache(CFG), "-o", fused).exit_code == 0
        assert cli("validate", fused, "--reference", export_cache(CFG), "--shapes", "2:5",
                   "--save-outputs", golden).exit_code == 0
        for path in (fused, golden):
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    finally:
        os.umask(old)


def test_external_data_honours_the_umask(export_cache, tmp_path, monkeypatch):
    import mha_onnx.graph.files as graphio

    monkeypatch.setattr(graphio, "EXTERNAL_DATA_THRESHOLD", 1)
    old = os.umask(0o027)
    try:
        graphio.write_model(onnx.load(export_cache(CFG)), tmp_path / "big.onnx", force=False)
    finally:
        os.umask(old)
    for name in ("big.onnx", "big.onnx.data"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640, name


def test_every_exit_code_of_the_readme(export_cache, tmp_path, monkeypatch):
    src = export_cache(CFG)
    assert cli("inspect", src).exit_code == 0
    assert cli("inspect", tmp_path / "missing.onnx").exit_code == 2
    assert cli("validate", src, "--providers", "cuda", "--shapes", "1:4").exit_code == 3
    assert cli("validate", src, "--atol", "0", "--rtol", "0", "--shapes", "2:9").exit_code in (0, 1)

    import mha_onnx.rewrite.lower.ort as lower

    real = lower.padding_loop
    monkeypatch.setattr(lower, "padding_loop",
                        lambda op, info, q3, k, v, is_3d: op.Mul(real(op, info, q3, k, v, is_3d),
                                                                 info.const(op, 1.5)))
    out = tmp_path / "wrong.onnx"
    mismatch = cli("fuse", src, "-o", out)
    assert mismatch.exit_code == 1 and "differs from the original" in mismatch.output
    assert not out.exists()


def test_validate_exit_1_on_a_changed_golden_output(export_cache, tmp_path):
    src = export_cache(CFG)
    golden = tmp_path / "golden.npz"
    assert cli("validate", src, "--save-outputs", golden, "--shapes", "2:7,1:3").exit_code == 0
    assert cli("validate", src, "--save-outputs", golden, "--shapes", "2:7").exit_code == 2
    same = cli("validate", src, "--load-outputs", golden, "--json")
    assert same.exit_code == 0, same.output
    assert any(c["against"] == "golden" for c in json.loads(same.output)["comparisons"])
    data = dict(np.load(golden))
    key = next(k for k in data if "/output/" in k)
    data[key] = data[key] + np.float32(0.01)
    changed = tmp_path / "changed.npz"
    np.savez(changed, **data)
    assert cli("validate", src, "--load-outputs", changed).exit_code == 1


# -- real inputs -------------------------------------------------------------------------------------

def test_integer_masks_are_known_by_use_not_name():
    """An int input used as a mask gets 0/1; one used to index a table stays below its rows."""
    proto = model([node("Cast", ["odd_name"], "f", to=1), node("Mul", ["f", "x"], "y"),
                   node("Gather", ["table", "tokens"], "e", axis=0)],
                  [tensor("odd_name", 7, ["B", "S"]), tensor("x", 1, ["B", "S"]),
                   tensor("tokens", 7, ["B", "S"])], ["y", "e"], out_types={"y": (1, ["B", "S"]), "e": (1, ["B", "S", 3])})
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((5, 3), np.float32), "table"))
    roles = {s.name: (s.role, s.bound) for s in input_specs(proto)}
    assert roles["odd_name"] == ("mask", 2) and roles["tokens"] == ("ids", 5)
    assert Graph(proto)  # a valid graph


def test_fuse_verifies_with_given_inputs(export_cache, tmp_path):
    src = export_cache(CFG)
    feeds = tmp_path / "in.npz"
    mask = np.zeros((3, 11), bool)
    mask[1, 6:] = True
    np.savez(feeds, query=np.random.default_rng(0).standard_normal((3, 11, 32)).astype(np.float32),
             key_padding_mask=mask)
    result = cli("fuse", src, "-o", tmp_path / "f.onnx", "--inputs", feeds, "--json")
    assert result.exit_code == 0, result.output
    cases = {r["case"] for r in json.loads(result.output)["verification"]["results"]}
    assert cases == {"given inputs (batch=3, seq_q=11)"}
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, query=np.zeros((3, 11), np.float32))
    refused = cli("fuse", src, "-o", tmp_path / "g.onnx", "--inputs", wrong)
    assert refused.exit_code == 2 and "lacks input(s) key_padding_mask" in refused.output


def test_lengths_the_model_refuses_are_left_unchecked_and_said(zoo, tmp_path):
    """A BERT with 128 positions cannot run the cases past the key-padding forms' thresholds
    (128 and 1024 keys): fuse still writes (those branches are unreachable for the model)
    and says which cases went unchecked, instead of refusing the model."""
    path = tmp_path / "bert.onnx"
    onnx.save(zoo("hf_bert"), path)
    result = cli("fuse", path, "-o", tmp_path / "f.onnx", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    skipped = report["verification"]["skipped"]
    assert [why.split(" (batch")[0] for why in skipped] == [
        "past a form threshold (128)", "past a form threshold (1025)"]
    assert all("the original does not run there" in why for why in skipped)
    assert report["verification"]["passed"]


def test_an_original_ort_refuses_is_the_inputs_fault_not_fuses():
    """A float16 TorchScript export that mixes float32 and float16 inputs of one op does not
    load in ORT; its fused graph keeps that op, so verify says the original is what is
    broken (exit 2), not that fuse wrote an invalid graph (seen on Starcoder2 in float16)."""
    from onnx import TensorProto, helper

    from mha_onnx.errors import ModelFileError
    from mha_onnx.rewrite.check.verify import verify

    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "scale"], ["y"], axis=-1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 4])],
        [helper.make_tensor("scale", TensorProto.FLOAT, [4], [1.0] * 4)])
    broken = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(ModelFileError, match="refuses the original model"):
        verify(broken, broken)


def test_a_mismatch_where_the_original_gives_nan_says_so():
    """The original NaN where the fused graph is finite (and nowhere the other way): the
    error says the original gives NaN there and points at real inputs."""
    import numpy as np

    from mha_onnx.errors import FusionError
    from mha_onnx.rewrite.check.mismatch import refuse_mismatch
    from mha_onnx.rewrite.check.verify import CaseResult, Verification
    from mha_onnx.stats import compare

    expected = np.array([[np.nan, 1.0], [2.0, 3.0]], np.float32)
    got = np.array([[0.5, 1.0], [2.0, 3.0]], np.float32)
    verification = Verification((CaseResult("odd", "y", compare(got, expected)),))
    with pytest.raises(FusionError) as raised:
        refuse_mismatch(verification, [])
    assert "the original itself gives NaN in 1 values there" in str(raised.value)
    assert "--inputs" in raised.value.hint
    # an RMS normalisation with its epsilon dropped by an exporter: named, and how to avoid it
    with pytest.raises(FusionError) as raised:
        refuse_mismatch(verification, ["node_Sqrt_75"])
    assert "RMS normalisation node_Sqrt_75 has no epsilon" in str(raised.value)
    assert "optimize=False" in raised.value.hint
