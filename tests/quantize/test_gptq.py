"""--algorithm gptq (quantize/gptq.py, calibrated.py): with an identity Hessian it is ONNX
Runtime's RTN code for code; on correlated activations its outputs move less than RTN's;
the If-free copy its activations come from computes what the model does; on the trained
fixture it writes a file whose KL against the float model is below RTN's."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.quantize import gptq
from tests.paths import ROOT

TRAINED = ROOT / "tests" / "fixtures" / "trained"
EXPORTED = TRAINED / "llama-onnx" / "model.onnx"


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_an_identity_hessian_gives_ort_rtn_codes():
    from onnx import numpy_helper

    from mha_onnx.graph.walk import all_graphs
    from mha_onnx.quantize.config import QuantizeConfig
    from mha_onnx.quantize.weights import quantize_weights, read_apart

    model = onnx.load(EXPORTED)
    made = quantize_weights(model, QuantizeConfig())
    base = read_apart(model)
    floats = {t.name: t for g in all_graphs(base.graph) for t in g.initializer}
    tensors = {t.name: numpy_helper.to_array(t) for g in all_graphs(made.model.graph)
               for t in g.initializer}
    weights = {t.weight for t in made.targets if t.bits == 4}
    assert len(weights) == 21
    for weight in weights:
        w = numpy_helper.to_array(floats[weight])
        codes, scales = gptq.quantized(w, np.eye(w.shape[0]), 32)
        assert np.array_equal(gptq.packed(codes, 32), tensors[f"{weight}_Q4"]), weight
        np.testing.assert_allclose(scales, tensors[f"{weight}_scales"], rtol=1e-6)
    coarse = quantize_weights(model, QuantizeConfig(block_size=128))  # (K 352: padded to 384)
    tensors = {t.name: numpy_helper.to_array(t) for g in all_graphs(coarse.model.graph)
               for t in g.initializer}
    padded = [w for w in weights if numpy_helper.to_array(floats[w]).shape[0] % 128]
    assert padded
    for weight in padded:
        w = numpy_helper.to_array(floats[weight])
        codes, scales = gptq.quantized(w, np.eye(w.shape[0]), 128)
        assert np.array_equal(gptq.packed(codes, 128), tensors[f"{weight}_Q4"]), weight
        np.testing.assert_allclose(scales.ravel(), tensors[f"{weight}_scales"].ravel(),
                                   rtol=1e-6)


def test_outputs_move_less_than_under_rtn():
    rng = np.random.default_rng(0)
    mix = rng.standard_normal((64, 64))
    x = rng.standard_normal((512, 64)) @ mix  # (correlated input dims)
    w = rng.standard_normal((64, 48))
    errors = {}
    for name, hessian in (("rtn", np.eye(64)), ("gptq", x.T @ x)):
        codes, scales = gptq.quantized(w, hessian, 16)
        back = ((codes.astype(np.float64) - 8).reshape(48, 4, 16) * scales[..., None])
        errors[name] = np.linalg.norm(x @ w - x @ back.reshape(48, 64).T)
    assert errors["gptq"] < 0.8 * errors["rtn"], errors


def test_the_if_free_copy_computes_what_the_model_does():
    from mha_onnx.quantize.feeds import decoder_feeds, session_outputs
    from mha_onnx.runtime.ort import OrtRunner

    model = onnx.load(EXPORTED)
    feeds, _ = decoder_feeds(model, str(EXPORTED), 2, 24, seed=0)

    def run(proto, names):
        with OrtRunner(proto.SerializeToString()) as runner:
            out = runner.infer({k: v for k, v in feeds.items() if k in runner.input_names})
        return {n: out[n] for n in names}

    flat = gptq.flattened(model, run)
    assert not any(n.op_type == "If" for n in flat.graph)
    found = gptq.activations(flat, ["val_86_packed3"])  # (read inside the Ifs' branches)
    assert found
    got = session_outputs(ir.to_proto(flat), feeds)
    want = session_outputs(str(EXPORTED), feeds)
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)


def test_gptq_on_the_trained_fixture(tmp_path):
    """From the training text's tokens (not the held-out): KL below RTN's on the same
    prompts, every weight through GPTQ; refused without --calibration, with int8 weights,
    and --calibration without GPTQ."""
    from tokenizers import Tokenizer

    from tools.train_fixture import docstrings

    tokenizer = Tokenizer.from_file(str(TRAINED / "llama" / "tokenizer.json"))
    given = tmp_path / "calibration.json"
    given.write_text(json.dumps([tokenizer.encode(docstrings()[0][:20000]).ids]))
    out = tmp_path / "gptq.onnx"
    made = _cli("quantize", EXPORTED, "-o", out, "--algorithm", "gptq", "--calibration", given,
                "--no-sensitivity", "--json")
    assert made.exit_code == 0, made.output
    report = json.loads(made.output)
    rtn = _cli("quantize", EXPORTED, "-o", tmp_path / "rtn.onnx", "--no-sensitivity", "--json")
    assert report["accuracy"]["kl_mean"] < json.loads(rtn.output)["accuracy"]["kl_mean"]
    assert any(n.startswith("GPTQ: 21 weight(s) from") for n in report["notes"])
    assert _cli("validate", out).exit_code == 0
    for args in (["--algorithm", "gptq"], ["--algorithm", "gptq", "--weights", "int8",
                                           "--calibration", given],
                 ["--calibration", given]):
        refused = _cli("quantize", EXPORTED, "-o", tmp_path / "x.onnx", *args)
        assert refused.exit_code == 2, (args, refused.output)


def test_an_encoder_calibrates_on_its_input_ids(tmp_path):
    """Optimum's BERT (nobody here wrote it): --calibration's windows as its input_ids
    (mask all ones, token types zero); every weight calibrated, the output nearer the float
    model's than RTN's; ids past the vocabulary refused."""
    from tests.paths import OPTIMUM

    source = OPTIMUM / "bert" / "model.onnx"
    given = tmp_path / "ids.json"
    given.write_text(json.dumps([list(np.random.default_rng(0).integers(3, 90, 512))],
                                default=int))
    errors = {}
    for algorithm in ("rtn", "gptq"):
        extra = ["--calibration", given] if algorithm == "gptq" else []
        made = _cli("quantize", source, "-o", tmp_path / f"{algorithm}.onnx", "--algorithm",
                    algorithm, *extra, "--no-sensitivity", "--no-check", "--json")
        assert made.exit_code == 0, made.output
        report = json.loads(made.output)
        errors[algorithm] = report["accuracy"]["outputs"][0]["mean_abs"]
    assert any(n.startswith("GPTQ: 12 weight(s)") for n in report["notes"]), report["notes"]
    assert errors["gptq"] < errors["rtn"], errors
    given.write_text(json.dumps([[5, 100000]]))
    refused = _cli("quantize", source, "-o", tmp_path / "x.onnx", "--algorithm", "gptq",
                   "--calibration", given)
    assert refused.exit_code == 2 and "vocabulary" in refused.output, refused.output


def test_branches_with_initializers_of_one_name_flatten_apart():
    """Sibling branches (Optimum's merged decoders, other exporters) may each hold an
    initializer of the same name: each moves up under a name of its own."""
    from onnx import TensorProto, helper, numpy_helper

    from mha_onnx.quantize.feeds import session_outputs

    def branch(tag: str, value: float) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node("Add", ["x", "k"], [f"y{tag}"])], tag, [],
            [helper.make_tensor_value_info(f"y{tag}", TensorProto.FLOAT, [2])],
            [numpy_helper.from_array(np.full(2, value, np.float32), "k")])

    ifs = [helper.make_node("If", ["c"], [f"out{i}"], then_branch=branch(f"t{i}", 1.0 + i),
                            else_branch=branch(f"e{i}", -1.0)) for i in range(2)]
    graph = helper.make_graph(ifs, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, [2])
                               for i in range(2)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    feeds = {"x": np.zeros(2, np.float32), "c": np.array(True)}
    flat = gptq.flattened(model, lambda proto, names: {
        n: session_outputs(proto, feeds)[n] for n in names})
    got = session_outputs(ir.to_proto(flat), feeds)
    assert got["out0"].tolist() == [1.0, 1.0] and got["out1"].tolist() == [2.0, 2.0]
