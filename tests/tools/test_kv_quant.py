"""tools/experiments/kv_quant.py: ORT's CPU GroupQueryAttention on a quantized shared
cache runs, and its figures are what the experiment says they are."""

from __future__ import annotations

import argparse

import numpy as np

from tools.experiments import kv_quant


def test_each_cache_form_runs_a_prompt_and_a_step_on_a_shared_buffer():
    args = argparse.Namespace(heads=4, kv_heads=2, head_size=16, threads=1, steps=1, rounds=1)
    result = kv_quant.measure(64, args)
    assert set(result) == set(kv_quant.FORMS)
    times, error, cosine, nbytes = result["float32"]
    assert error == 0.0 and cosine > 0.999999 and len(times) == 1
    int8 = result["int8, per channel"]
    assert int8[3] * 4 == nbytes  # (a quarter of the bytes)
    assert 0 < int8[1] < 0.1 and int8[2] > 0.999  # close to the float cache, not equal
    assert result["int4, per channel"][3] * 8 == nbytes


def test_a_whole_decoder_on_an_int8_cache_stays_near_its_float_cache(tmp_path, capsys):
    """kv_quant_model.py on the Optimum Llama fused with a shared cache: every layer's
    cache int8 (the file's pasts and presents too), the step's logits near the float
    cache's, the same greedy tokens."""
    import onnx

    from mha_onnx.generate.genai import deliver_genai
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.policy import FormPolicy
    from tests.paths import OPTIMUM
    from tools.experiments import kv_quant_model

    out = tmp_path / "model.onnx"
    fuse_file(OPTIMUM / "llama" / "model.onnx", out, policy=FormPolicy(kv_cache="shared"))
    deliver_genai(out, OPTIMUM / "llama" / "model.onnx")  # (as `mha-onnx fuse` writes it)
    genai = out.with_name("model.genai.onnx")
    proto = onnx.load(genai, load_external_data=False)
    scales = {i.name: np.full((1, 2, 1, 16), 0.05) for i in proto.graph.input
              if i.name.startswith("past_key_values.")}
    made = kv_quant_model.quantized_cache(proto, scales)
    caches = [v for v in (*made.graph.input, *made.graph.output) if ".key" in v.name
              or ".value" in v.name]
    assert caches and {v.type.tensor_type.elem_type for v in caches} == {onnx.TensorProto.INT8}
    kv_quant_model.main([str(genai), "--context", "24", "--calibration", "16", "--steps", "4",
                         "--rounds", "1", "--threads", "1"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| int8")]
    kl_mean, top1, kept = row[0].split(" | ")[3], row[0].split(" | ")[5], row[0].split(" | ")[6]
    assert 0 < float(kl_mean) < 1e-3 and float(top1) == 1.0 and kept.startswith("4/4")


def test_kv_families_prints_a_row_per_family(tmp_path, capsys):
    """tools/experiments/kv_families.py on one fixture: both quantized files written, their
    KL and whether generate's tokens agree."""
    from tools.experiments import kv_families

    kv_families.main(["llama", "--out", str(tmp_path)])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0
    assert cells[3] == "yes" or cells[3].startswith("no: ")
    assert (tmp_path / "llama" / "kv8" / "model.onnx").is_file()
