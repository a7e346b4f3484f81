"""The trained fixture (tests/fixtures/trained/llama, tools/train_fixture.py): weights with
structure, so agreement figures mean something. The default int4 passes the default gate
with a top-1 agreement well above chance, a coarser quantization that costs more held-out
perplexity (docs/quantize-trained.md) fails it, and --mixed first-last finds the layers in a
torch.export file's node metadata."""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from tests.paths import ROOT

TRAINED = ROOT / "tests" / "fixtures" / "trained" / "llama"  # (bert beside it: the encoder)


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_the_fixture_learned_its_text():
    record = json.loads((TRAINED / "training.json").read_text())
    assert record["held_out_perplexity"] < record["uniform_perplexity"] / 20
    assert json.loads((TRAINED / "config.json").read_text())["tie_word_embeddings"]


@pytest.mark.slow
def test_the_default_gate_tells_a_good_int4_from_a_coarse_one(tmp_path):
    """Its committed export (tests/fixtures/trained/llama-onnx), three quantizations: the
    default passes, block 128 fails on KL and is not written, --mixed first-last puts layers
    0 and 3 in int8 (read from the node metadata: torch.export's node names carry none)."""
    from mha_onnx.graph.walk import all_nodes

    exported = TRAINED.parent / "llama-onnx" / "model.onnx"
    good = _cli("quantize", exported, "-o", tmp_path / "good.onnx", "--no-sensitivity",
                "--json")
    assert good.exit_code == 0, good.output
    figures = json.loads(good.output)["accuracy"]
    assert figures["top1"] > 0.85 and figures["kl_mean"] < 0.05
    coarse = _cli("quantize", exported, "-o", tmp_path / "coarse.onnx", "--block-size", "128",
                  "--no-sensitivity")
    assert coarse.exit_code == 1 and "KL" in coarse.output, coarse.output
    assert not (tmp_path / "coarse.onnx").exists()
    out = tmp_path / "mixed.onnx"
    mixed = _cli("quantize", exported, "-o", out, "--mixed", "first-last", "--no-check",
                 "--no-sensitivity")
    assert mixed.exit_code == 0, mixed.output
    bits = [a.i for n in all_nodes(onnx.load(out).graph) if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name == "bits"]
    assert bits.count(8) >= 8 and 4 in bits  # (layers 0 and 3: 4 MatMuls each at least)


def test_the_accuracy_is_measured_on_the_prompts_given(tmp_path):
    """--eval-prompts: the report's positions are the given prompts' (each cut to the
    shortest, at most 128 tokens), said in a note, and validate measures on them again; a
    prompt too short for greedy's 16 tokens, or text with no tokenizer beside the model, is
    refused (exit 2)."""
    import argparse
    import collections

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
    prompts = [tokenizer.encode(m.__doc__).ids for m in (json, argparse, collections)]
    given = tmp_path / "prompts.json"
    given.write_text(json.dumps(prompts))
    exported = TRAINED.parent / "llama-onnx" / "model.onnx"
    out = tmp_path / "q.onnx"
    result = _cli("quantize", exported, "-o", out, "--no-sensitivity", "--json",
                  "--eval-prompts", given)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    length = min(128, *(len(p) for p in prompts))
    assert report["accuracy"]["positions"] == 3 * length
    assert any("3 --eval-prompts prompt(s)" in n for n in report["notes"])
    again = _cli("validate", out)  # (on the prompts recorded, not random ids)
    assert again.exit_code == 0 and f"over {3 * length} positions" in again.output, again.output
    given.write_text(json.dumps([prompts[0], prompts[1][:9]]))
    short = _cli("quantize", exported, "-o", out, "--force", "--eval-prompts", given)
    assert short.exit_code == 2 and "16 or more" in short.output, short.output
    given.write_text(json.dumps(["some text"]))
    text = _cli("quantize", exported, "-o", out, "--force", "--eval-prompts", given)
    assert text.exit_code == 2 and "holds text" in text.output, text.output


def _calibration(folder) -> str:
    """Token ids of the training text (not the held-out), for --calibration."""
    from tokenizers import Tokenizer

    from tools.train_fixture import docstrings

    tokenizer = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
    given = folder / "calibration.json"
    given.write_text(json.dumps([tokenizer.encode(docstrings()[0][:20000]).ids]))
    return str(given)


def test_mixed_auto_keeps_the_fewest_sensitive_weights_wider(tmp_path):
    """--mixed auto on a quantization the gate refuses (block 128: KL past 0.05) writes
    one that passes, with N weights in int8 where N - 1 was measured failing."""
    from mha_onnx.graph.walk import all_nodes

    exported = TRAINED.parent / "llama-onnx" / "model.onnx"
    out = tmp_path / "auto.onnx"
    result = _cli("quantize", exported, "-o", out, "--block-size", "128", "--max-kl", "0.03",
                  "--mixed", "auto", "--no-sensitivity", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    trials = {t["kept"]: t for t in report["mixed_auto"]}
    kept = min(n for n, t in trials.items() if t["passed"])
    assert kept > 1 and not trials[0]["passed"] and not trials[kept - 1]["passed"]
    assert report["accuracy"]["kl_mean"] <= 0.03 and report["written"]
    bits = [a.i for n in all_nodes(onnx.load(out).graph) if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name == "bits"]
    assert bits.count(8) == kept == sum(b == 8 for b in report["matmuls"].values())
    assert any(f"the {kept} most sensitive weight(s) in int8" in n for n in report["notes"])


def test_mixed_auto_beside_gptq_keeps_weights_in_int8(tmp_path):
    """GPTQ's int4 with --mixed auto: the weights kept wider are int8, none float, and the
    written model's GPTQ note is said once."""
    exported = TRAINED.parent / "llama-onnx" / "model.onnx"
    gptq = _cli("quantize", exported, "-o", tmp_path / "gptq.onnx", "--block-size", "128",
                "--max-kl", "0.03", "--algorithm", "gptq", "--calibration", _calibration(tmp_path),
                "--mixed", "auto", "--no-sensitivity", "--json")  # (int8 beside GPTQ's int4)
    assert gptq.exit_code == 0, gptq.output
    report = json.loads(gptq.output)
    assert set(report["matmuls"].values()) == {4, 8}  # (none float)
    assert {t["form"] for t in report["mixed_auto"] if t["kept"]} == {"int8"}
    said = [n for n in report["notes"] if n.startswith("GPTQ: ")]  # (the written model's)
    assert len(said) == 1 and "keep RTN" not in said[0], said


def test_mixed_auto_keeps_float_beside_int8_weights_and_needs_the_check(tmp_path):
    """With the weights in int8 already, --mixed auto keeps some in float; beside --no-check
    it is refused."""
    exported = TRAINED.parent / "llama-onnx" / "model.onnx"
    int8 = _cli("quantize", exported, "-o", tmp_path / "int8.onnx", "--weights", "int8",
                "--max-kl", "0.0002", "--mixed", "auto", "--no-sensitivity", "--json")
    assert int8.exit_code == 0, int8.output
    forms = {t["form"] for t in json.loads(int8.output)["mixed_auto"] if t["kept"]}
    assert forms == {"float"} and 0 in json.loads(int8.output)["matmuls"].values()
    refused = _cli("quantize", exported, "-o", tmp_path / "x.onnx", "--mixed", "auto",
                   "--no-check")
    assert refused.exit_code == 2 and "--no-check" in refused.output, refused.output


def test_the_trained_encoder_quantizes_every_weight_and_gptq_moves_it_less(tmp_path):
    """The trained BERT-like encoder (tests/fixtures/trained/bert, tools/train_encoder.py;
    its fused export in bert-onnx): the default int4 passes the gate with every MatMul in
    4 bits (the packed Q/K/V inside the fused forms too), and GPTQ calibrated on training
    text moves last_hidden_state less than RTN."""
    from tokenizers import Tokenizer

    from tools.train_fixture import docstrings

    encoder = TRAINED.parent / "bert"
    record = json.loads((encoder / "training.json").read_text())
    assert record["masked_perplexity"] < record["uniform_perplexity"] / 5
    tokenizer = Tokenizer.from_file(str(encoder / "tokenizer.json"))
    given = tmp_path / "calibration.json"
    given.write_text(json.dumps([tokenizer.encode(docstrings()[0][:20000]).ids]))
    exported = TRAINED.parent / "bert-onnx" / "model.onnx"
    errors = {}
    for algorithm, extra in (("rtn", []), ("gptq", ["--calibration", given])):
        made = _cli("quantize", exported, "-o", tmp_path / f"{algorithm}.onnx", "--algorithm",
                    algorithm, *extra, "--no-sensitivity", "--json")
        assert made.exit_code == 0, made.output
        report = json.loads(made.output)
        assert set(report["matmuls"].values()) == {4} and len(report["matmuls"]) == 16
        errors[algorithm] = report["accuracy"]["outputs"][0]["mean_abs"]
    assert errors["gptq"] < 0.8 * errors["rtn"], errors
