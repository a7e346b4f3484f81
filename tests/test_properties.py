"""Property tests over graphs this project did not write: Hugging Face decoders with random
configs (heads, head sizes, grouped K/V ratios, eager or SDPA, float32 or float16) and torch.nn
attention in float16 and bfloat16. Every block is fused and verified, or left with a reason;
nothing else happens (no crash, no silent wrong answer)."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from mha_onnx.cli import main
from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.check.verify import verify
from tests.export_memo import exporting_examples

FAMILIES = ("llama", "mistral", "qwen2")


def _decoder(family, heads, head_dim, groups, attn, dtype):
    from tests.models import hf_decoder

    window = {"sliding_window": 8} if family == "mistral" else {}
    return hf_decoder(family, attn, dtype=dtype, heads=heads, head_dim=head_dim,
                      kv_heads=heads // groups, vocab=64, max_positions=256, **window)


@exporting_examples(5)  # (the same 5 every run: tests/export_memo.py)
@given(family=st.sampled_from(FAMILIES), heads=st.sampled_from([2, 4, 8]),
       head_dim=st.sampled_from([32, 36, 64, 128]), groups=st.sampled_from([1, 2]),
       attn=st.sampled_from(["eager", "sdpa"]), dtype=st.sampled_from(["float32", "float16"]))
@pytest.mark.slow
def test_random_decoder_configs_fuse_or_say_why(family, heads, head_dim, groups, attn, dtype):
    model = _decoder(family, heads, head_dim, groups, attn, dtype)
    fused, results, _ = fuse_model(model)
    assert results
    for result in results:
        assert result.status == "fused" or result.reason, result
        fp16_window_padding = dtype == "float16" and family == "mistral"  # see gqa_ok
        if result.status == "fused" and head_dim % 8 == 0 and not fp16_window_padding:
            assert "GroupQueryAttention" in result.form, (head_dim, result.form)
            assert f"{heads} q heads / {heads // groups} kv heads" in result.meaning or groups == 1
    assert verify(model, fused).passed


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_torch_nn_in_half_precisions(tmp_path, dtype):
    """float16 fuses and verifies; bfloat16 (no fused kernel on ORT's CPU) is left with the
    reason, or refused with one line if ORT cannot run the graph at all."""
    from tests.models import D, TorchMha, batch_seq_dims, export

    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    module = TorchMha(True, "causal").to(dtype)
    proto = export(module, (torch.randn(2, 5, D).to(dtype),), {"query": {0: batch, 1: seq}})
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    result = CliRunner().invoke(main, ["fuse", str(path), "-o", str(tmp_path / "f.onnx"), "--json"])
    if dtype == torch.float16:
        assert result.exit_code == 0, result.output
        assert '"status": "fused"' in result.output
    else:
        assert result.exit_code in (0, 2), result.output
        if result.exit_code == 2:  # refused with one reason: under --json, a JSON object
            error = json.loads(result.output)
            assert error["exit_code"] == 2 and error["error"], error
        else:
            assert "has no fused attention kernel" in result.output, result.output


@pytest.mark.slow
def test_float16_window_with_padding_stays_exact():
    """Found by the property test: ORT's float16 GQA with a window disagrees on the padded
    query rows of right-padded batches longer than the window, so that case takes GQA only
    when no key is padded and the dense form otherwise; verification over both branches
    (padded rows, no padding, S beyond the window) passes."""
    from mha_onnx.rewrite.check.cases import verification_cases

    model = _decoder("mistral", 4, 64, 1, "eager", "float16")
    fused, results, _ = fuse_model(model)
    (block,) = results
    assert block.form.startswith("If(no key padded): GroupQueryAttention")
    assert block.form.endswith("| MHA + attention_bias") and "window 8" in block.meaning
    cases = verification_cases(model, results)
    assert "odd, no key padded" in [c.label for c in cases]
    assert verify(model, fused, cases=cases).passed
