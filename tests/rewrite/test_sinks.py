"""Attention sinks (rewrite/recognise/attention_sinks.py): GPT-OSS's learned logit per head, concatenated to the
scores and sliced off the probabilities, fused onto GroupQueryAttention's head_sink, with
MultiHeadAttention and one key of zeros where GQA does not apply (left-padded rows); Optimum's
GPT-OSS export end to end."""

from __future__ import annotations

import io
import math

import numpy as np
import onnx
import pytest
import torch

from mha_onnx.graph.walk import all_nodes
from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.runtime.ort import OrtRunner
from tests.fusing import fused_and_checked
from tests.paths import OPTIMUM


class SinkAttention(torch.nn.Module):
    """GPT-OSS's attention as its modeling code writes it: grouped K/V repeated, causal
    (optionally windowed) and key padding mask, sinks [H] in every row's softmax."""

    def __init__(self, window: int = 0, d: int = 64, heads: int = 4, kv: int = 2) -> None:
        super().__init__()
        self.h, self.kv, self.dh, self.window = heads, kv, d // heads, window
        self.q = torch.nn.Linear(d, heads * self.dh)
        self.k = torch.nn.Linear(d, kv * self.dh)
        self.v = torch.nn.Linear(d, kv * self.dh)
        self.o = torch.nn.Linear(heads * self.dh, d)
        self.sinks = torch.nn.Parameter(torch.randn(heads) * 2)

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.dh).transpose(1, 2)
        k, v = (p(x).view(b, s, self.kv, self.dh).transpose(1, 2) for p in (self.k, self.v))
        rep = self.h // self.kv
        k, v = (t[:, :, None].expand(b, self.kv, rep, s, self.dh).reshape(b, self.h, s, self.dh)
                for t in (k, v))
        scores = q @ k.transpose(2, 3) / math.sqrt(self.dh)
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        allowed = j <= i
        if self.window:
            allowed = allowed & (i - j < self.window)
        keep = allowed[None, None] & attention_mask[:, None, None, :].bool()
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        sink = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, -1))


def _export(module: torch.nn.Module) -> onnx.ModelProto:
    """TorchScript exporter, as Optimum exports (opset 18, batch and length dynamic)."""
    buffer = io.BytesIO()
    dims = {0: "batch", 1: "seq"}
    x, mask = torch.randn(2, 8, 64), torch.ones(2, 8, dtype=torch.int64)
    torch.onnx.export(module.eval(), (x, mask), buffer, dynamo=False, opset_version=18,
                      input_names=["x", "attention_mask"], output_names=["y"],
                      dynamic_axes={"x": dims, "attention_mask": dims, "y": dims})
    return onnx.load_from_string(buffer.getvalue())


def _run(model: onnx.ModelProto, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with OrtRunner(model.SerializeToString()) as run:
        return run.infer({"x": x, "attention_mask": mask})["y"]


@pytest.mark.slow  # (torch.onnx.export)
@pytest.mark.parametrize("window", [0, 4])
def test_sinks_run_on_gqa_head_sink_and_the_general_form_keeps_them(window):
    torch.manual_seed(0)
    module = SinkAttention(window)
    original = _export(module)
    fused, results = fused_and_checked(original)  # verified over every branch's cases
    assert results[0].details["mask_meaning"]["causal"]
    assert results[0].form.startswith("If(right padding): GroupQueryAttention (causal") \
        and "sinks)" in results[0].form, results[0].form
    gqa = [n for n in all_nodes(fused.graph) if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 1 and len(gqa[0].input) == 12 and gqa[0].input[11]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 12, 64)).astype(np.float32)
    for pad in (0, 4):  # right-padded rows on GQA; a left-padded row takes the general form
        mask = np.ones((3, 12), np.int64)
        mask[1, :pad], mask[2, 12 - pad:] = 0, 0
        np.testing.assert_allclose(_run(fused, x, mask), _run(original, x, mask),
                                   rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the sinks matter: without them the output is another
        module.sinks.zero_()
    without = _run(_export(module), x, np.ones((3, 12), np.int64))
    assert np.abs(without - _run(fused, x, np.ones((3, 12), np.int64))).max() > 1e-2


@pytest.mark.slow
def test_sinks_are_left_for_a_target_without_a_kernel_for_them():
    torch.manual_seed(0)
    _, results, _ = fuse_model(_export(SinkAttention()), FormPolicy(target="onnx"))
    assert results[0].status == "left"
    assert "attention sinks are fused for --target ort only" in results[0].reason


@pytest.mark.transformers
def test_optimum_gpt_oss_runs_its_sinks_on_gqa_and_generates_transformers_tokens(tmp_path):
    """Optimum's GPT-OSS export (sinks, window 16 on alternate layers, MoE): every block on
    GroupQueryAttention with past and head_sink, and the fused file generates the tokens
    transformers generated from the same weights (alone and a left-padded batch); a shared
    cache is refused, saying why (GQA on a shared buffer with sinks read 0.13 off the
    original's logits for a prompt past the window)."""
    import json

    from mha_onnx.errors import ConfigError
    from mha_onnx.rewrite import fuse_file
    from tests.generate.test_generate import ours

    source = OPTIMUM / "gpt_oss"
    want = json.loads((source / "generate.json").read_text())
    out = tmp_path / "model.onnx"
    report = fuse_file(source / "model.onnx", out)
    assert [b.status for b in report.blocks] == ["fused", "fused"]
    assert "window 16, sinks (presents from it)" in report.blocks[0].form
    gqa = [n for n in all_nodes(onnx.load(out).graph) if n.op_type == "GroupQueryAttention"]
    assert gqa and all(len(n.input) == 12 and n.input[11] for n in gqa)
    assert ours(out, want["prompts"][:1]) == want["batch1"]
    assert ours(out, want["prompts"]) == want["batch3"]
    with pytest.raises(ConfigError, match="attention sinks"):
        fuse_file(source / "model.onnx", tmp_path / "shared.onnx",
                  policy=FormPolicy(kv_cache="shared"))
