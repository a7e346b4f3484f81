"""KV-cache decoding: the export with past/present, its PyTorch reference, the fused form
(the model's interface kept), decode validation over a prompt and 16 steps, and per-token
profiling against the memory bandwidth."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.config import MhaConfig
from mha_onnx.errors import ConfigError
from mha_onnx.inputs import ShapeCase, contract_specs, make_inputs
from mha_onnx.reference import build_reference, run_reference
from mha_onnx.rewrite.fuse import verification_cases
from tests.fusing import fused_and_checked, ops

CFG = MhaConfig(d_model=32, num_heads=4, mask="causal", kv_cache=True, name="kv")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cache_configs_are_checked():
    with pytest.raises(ConfigError, match="causal self-attention"):
        MhaConfig(mask="none", kv_cache=True)
    with pytest.raises(ConfigError, match="key padding of a KV-cache model"):
        MhaConfig(mask="causal", cache_padding=True)


@pytest.mark.parametrize("padding", [False, True], ids=["plain", "left-padded"])
def test_export_interface_and_decode_against_pytorch(export_cache, padding):
    cfg = CFG.replace(cache_padding=padding)
    model = onnx.load(export_cache(cfg))
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    assert dims["past_key"] == ["batch", 4, "past_seq", 8]
    assert dims["present_value"] == ["batch", 4, "past_seq + seq_q", 8]
    assert ("key_padding_mask" in dims) == padding
    result = cli("validate", export_cache(cfg), "--json")
    assert result.exit_code == 0, result.output
    steps = {c["case"] for c in json.loads(result.output)["comparisons"] if c["case"].startswith("decode")}
    assert steps == {"decode prompt"} | {f"decode step {n}" for n in range(1, 17)}


def test_the_reference_is_causal_from_the_end():
    """Query i of S new tokens after P cached ones sees keys 0..P+i: a step that feeds every
    token at once equals feeding them one by one."""
    module = build_reference(CFG, seed=0)
    feeds = make_inputs(contract_specs(CFG), ShapeCase("x", {"batch": 2, "seq_q": 5, "past_seq": 3}))
    whole = run_reference(module, feeds)
    past_k, past_v = feeds["past_key"], feeds["past_value"]
    for i in range(5):
        step = run_reference(module, {"query": feeds["query"][:, i:i + 1], "past_key": past_k,
                                      "past_value": past_v})
        np.testing.assert_allclose(step["output"][:, 0], whole["output"][:, i], atol=1e-5)
        past_k, past_v = step["present_key"], step["present_value"]
    np.testing.assert_allclose(past_k, whole["present_key"], atol=1e-6)


@pytest.mark.parametrize("padding", [False, True], ids=["plain", "left-padded"])
def test_fused_keeps_the_interface_and_the_decode(export_cache, tmp_path, padding):
    src = export_cache(CFG.replace(cache_padding=padding))
    fused, results = fused_and_checked(onnx.load(src))
    (block,) = results
    assert block.form.startswith("If(one new token)") and "bottom-right" in block.meaning
    assert "GroupQueryAttention" in ops(fused) and "MultiHeadAttention" in ops(fused)
    original = onnx.load(src)
    assert [i.name for i in fused.graph.input] == [i.name for i in original.graph.input]
    assert [o.name for o in fused.graph.output] == [o.name for o in original.graph.output]
    path = tmp_path / "fused.onnx"
    onnx.save(fused, path)
    result = cli("validate", path, "--reference", src, "--shapes", "2:3:4")
    assert result.exit_code == 0, result.output
    assert "decode step 16" in result.output


def test_decode_profile_reports_the_bandwidth_roofline(export_cache):
    result = cli("profile", export_cache(CFG), "--decode", "--context", "16,64", "--iters", "2",
                 "--no-ops", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["decode"] and data["bandwidth_gbps"]["cpu float32"] > 0
    first, second = data["points"]
    assert (first["seq_len"], second["seq_len"]) == (16, 64)
    assert second["cache_bytes"] == 4 * second["cache_bytes"] // 4 == 2 * 1 * 4 * 64 * 8 * 4
    assert all(0 < p["bandwidth_fraction"] for p in data["points"])
    assert first["tokens_per_s"] > 0


def test_report_shows_a_decode_step_against_the_bandwidth(export_cache, tmp_path):
    profile = tmp_path / "decode.json"
    result = cli("profile", export_cache(CFG), "--decode", "--context", "16", "--iters", "2",
                 "--no-ops", "--json")
    assert result.exit_code == 0, result.output
    profile.write_text(result.output[result.output.index("{"):])
    result = cli("report", str(profile), "-o", str(tmp_path / "r.md"))
    assert result.exit_code == 0, result.output
    row = next(line for line in (tmp_path / "r.md").read_text().splitlines()
               if line.startswith("| ") and " ms / " in line)
    assert re.search(r" ms / [\d,]+ / \d+ % bw / ", row), row


def test_decode_profile_needs_a_cache(export_cache):
    result = cli("profile", export_cache(CFG.replace(kv_cache=False)), "--decode",
                 "--context", "16", "--iters", "1", "--no-ops")
    assert result.exit_code == 2 and "needs a model with a KV cache" in result.output


@pytest.mark.parametrize("name, kernel", [("cached_gpt2_style", "MultiHeadAttention"),
                                          ("cached_grouped", "GroupQueryAttention")])
def test_a_cache_written_elsewhere_is_recognised(zoo, name, kernel):
    """GPT-2's legacy layer (and a grouped one, Llama's repeat_kv after the cache): torch.cat
    of past and new keys, the causal mask sliced from a cached buffer at [T - S:T, :T]: read
    as causal aligned to the end of the keys; a step runs on the kernel's own past/present,
    so the presents come out of the If and the Concats run only for prompts."""
    original = zoo(name)
    fused, results = fused_and_checked(original)
    (block,) = results
    assert block.form.startswith(f"If(one new token): {kernel} with past")
    assert block.details["mask_meaning"]["alignment"] == "bottom-right"
    assert [c.label for c in verification_cases(original, results)][-2:] == [
        "no past (prompt)", "one new token (decode)"]
    graph = ir.from_proto(fused).graph
    assert [o.name for o in graph.outputs] == [o.name for o in original.graph.output]
    assert all(o.producer().op_type == "If" for o in graph.outputs[1:])
    assert "Concat" not in {n.op_type for n in graph if n.outputs[0].shape and
                            len(n.outputs[0].shape) == 4}
