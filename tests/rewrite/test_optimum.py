"""The files users have: Optimum exports (TorchScript exporter, no value_info, shapes computed
by Shape chains, masks built the TorchScript way, ``past_key_values.N.*`` caches), committed
under tests/fixtures/optimum by tools/optimum_fixtures.py (`make fixtures`)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from mha_onnx.graph.inputs import input_specs
from mha_onnx.parity import ValidateConfig, validate_model
from mha_onnx.rewrite import fuse_file
from mha_onnx.rewrite.policy import FormPolicy
from tests.paths import OPTIMUM

FIXTURES = OPTIMUM
FILES = sorted(FIXTURES.glob("*/*.onnx"))
DECODERS = [p for p in FILES
            if json.loads((p.parent / "versions.json").read_text())["task"]
            == "text-generation-with-past"]


# decoders whose rotation (head sizes of 16k) GroupQueryAttention takes over: rotate_half
# (Llama, Mistral, Phi3, Qwen2, Qwen3 after its q/k norms), Falcon's on heads sliced out of
# its fused QKV, GPT-J's interleaved partial one before the heads' transpose
ROTATING = ("llama", "mistral", "phi3", "qwen2", "qwen3", "falcon", "gptj")


def _id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """fused(path) -> (fuse's report, the fused file) with the default policy, fused once per
    worker: the decoders' decode test reads the file the fuse test checked."""
    made: dict[Path, tuple] = {}

    def get(path: Path):
        if path not in made:
            out = tmp_path_factory.mktemp(path.parent.name) / "fused.onnx"
            made[path] = fuse_file(path, out), out
        return made[path]

    return get


def test_fixtures_say_what_made_them():
    assert len(FILES) >= 20
    for folder in {p.parent for p in FILES}:
        made = json.loads((folder / "versions.json").read_text())
        assert made["versions"]["optimum-onnx"] == "0.1.0"
        assert made["config"]["hidden_size"] <= 64
        assert all((folder / f).stat().st_size < 1_000_000 for f in made["files"])
        assert not onnx.load(folder / made["files"][0]).graph.value_info  # as Optimum wrote it


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=_id)
def test_optimum_exports_fuse_every_block(path, fused):
    report, _ = fused(path)
    left = [(b.block, b.reason) for b in report.blocks if b.status != "fused"]
    if path.parent.name == "bloom":  # ALiBi from attention_mask's cumsum, added on merged
        # heads; its 4-D mask added after the heads split: causal + padding all the same
        assert all(b.meaning.startswith("causal (bottom-right) + key padding + bias on merged "
                                        "heads") for b in report.blocks)
        assert all("If(no past): GroupQueryAttention (causal, bias)" in b.form
                   for b in report.blocks)
    assert not left, left
    assert report.verification is not None and report.verification.passed
    forms = [b.form for b in report.blocks]
    meanings = [b.meaning for b in report.blocks]
    if path.parent.name == "deepseek_v3":  # MLA: V's heads narrower than Q's and K's, which
        # no ORT kernel with past takes: the step over the concatenated cache, unmasked; the
        # prompt on GQA with V padded with zeros to K's head size, the output cut back
        assert all(f.startswith("If(one new token): MHA key_padding_mask over the cache")
                   and "If(no past): GroupQueryAttention (causal)" in f for f in forms), forms
    elif path in DECODERS and path.parent.name != "bloom":
        assert all(m.startswith("causal (bottom-right) + key padding") for m in meanings), meanings
        assert all("If(one new token" in f for f in forms), forms
        # a step on the kernel's own past (MHA, or GQA for grouped K/V), never the cache
        # repeated and re-read: GPT-2's and Falcon's K^T and shape-computed scales included
        assert all("with past" in f and "(presents from it)" in f for f in forms), forms
    if path.parent.name in ROTATING:  # the exporter's rotation moved into the kernel
        assert all("rotary inside" in f for f in forms), forms
    if path.parent.name == "gpt_oss":  # sinks on GQA's head_sink, window 16 on layer 0
        assert all(m.endswith("attention sinks") for m in meanings), meanings
        assert all("sinks (presents from it)" in f for f in forms), forms
    if path.parent.name in ("bert", "roberta", "distilbert", "electra"):
        assert all(m == "key padding" for m in meanings), meanings
    if path.parent.name == "mpt":  # ALiBi (a table sliced to the keys), then the 4-D mask
        assert all(m == "causal (bottom-right) + key padding + position bias"
                   for m in meanings), meanings
    if path.parent.name in ("swin", "donut_swin", "swinv2"):  # the shifted blocks' window
        # mask, added on a [B, nW, heads, N, N] view of the scores, made a bias on the scores
        assert any("mask(s) added on a view" in n for n in report.notes), report.notes
    if path.parent.name == "detr":  # its pixel mask on a [B, H, T, S] view of [B*H, T, S]
        assert any("mask(s) added on a view" in n for n in report.notes), report.notes
    if path.parent.name == "siglip_vision":  # the pooling head (a probe query of batch 1)
        assert len(report.blocks) == 3 and "head/attention" in report.blocks[-1].block
    if path.parent.name == "longt5":  # local attention: 5-D Einsums over blocks, merged
        assert any("written as Einsums" in n for n in report.notes), report.notes
        assert all(f == "MultiHeadAttention + attention_bias" for f in forms), forms
    if path.parent.name == "swinv2":  # its learned logit scale per head, folded into Q
        assert len(meanings) == 4 and all("a scale per head" in m for m in meanings), meanings
    if path.name == "decoder_model_merged.onnx":  # both branches fused, both verified
        assert len(report.blocks) == 8
        cases = {r.case for r in report.verification.results}
        assert any("use_cache_branch=True" in c for c in cases)
        assert any("use_cache_branch=False" in c for c in cases)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DECODERS if p.parent.name in
                                  ("llama", "gpt2", "falcon", "phi3", "gpt_neo")], ids=_id)
def test_optimum_decoders_share_their_cache_with_per_row_lengths(path, tmp_path):
    """--kv-cache shared with per-row lengths read from attention_mask, verified on
    left-padded prompts and steps: grouped K/V, K^T with a shape-computed scale, one K/V head,
    fused QKV (every Optimum decoder fixture but BLOOM, whose cache is [B*H, D, T], passed this
    on 2026-12-01; four kept here for the suite's time), and GPT-Neo's two mask terms (the
    left-padded prompt's padded queries as its masks add up, a window on layer 1)."""
    report = fuse_file(path, tmp_path / "shared.onnx", policy=FormPolicy(kv_cache="shared"))
    assert report.verification is not None and report.verification.passed
    assert all("(per-row lengths" in b.form for b in report.blocks), report.render()
    cases = {r.case for r in report.verification.results}
    assert any("one new token (decode), left-padded rows" in c for c in cases), cases
    assert any("no past (prompt), left-padded rows" in c for c in cases), cases
    if path.parent.name == "gpt_neo":
        assert "window 16" in report.blocks[1].form, report.render()


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DECODERS if p.parent.name in
                                  ("llama", "gpt2", "qwen2", "phi3", "mpt", "gptj")],
                         ids=_id)
def test_optimum_decoders_decode_like_the_export(path, fused):
    """validate decodes a prompt and 16 steps through Optimum's names, fused against the
    original, on the fused model's own chain (MPT: its ALiBi added on the kernels)."""
    report = validate_model(fused(path)[1], ValidateConfig(reference=str(path)))
    assert report, report.render()
    assert sum(c.case.startswith("decode step") for c in report.comparisons) >= 16
    # which kernels ran: prompt, first and last step of both chains, each on a fused kernel
    assert len(report.decode_kernels) == 6, report.decode_kernels
    assert all("Attention x2" in k for k in report.decode_kernels), report.decode_kernels


def test_image_dims_come_from_the_graph():
    """pixel_values [batch_size, num_channels, height, width]: channels from the Conv
    weight, the image size the model runs at (its position table fixes it)."""
    specs = {s.name: s for s in input_specs(onnx.load(FIXTURES / "vit" / "model.onnx"))}
    assert specs["pixel_values"].dims == ("batch_size", 3, 32, 32)


def test_attention_mask_of_a_torchscript_export_is_a_mask():
    """attention_mask reaches the graph through Cast -> Flatten -> Gather (TorchScript's
    advanced indexing): a 0/1 keep mask, not token ids."""
    specs = {s.name: s for s in input_specs(onnx.load(FIXTURES / "llama" / "model.onnx"))}
    assert specs["attention_mask"].role == "mask"
    assert specs["input_ids"].role == "ids" and specs["input_ids"].bound == 128


@pytest.mark.models
def test_a_shared_fusion_writes_every_value_it_shaped_without_a_warning(tmp_path, caplog):
    """The query's [B, S, H*D] copy carries its shape (one guard for every layer) and its
    type: onnx_ir skips a shape without a type, with a warning per value and file."""
    import logging

    from mha_onnx.generate.decode import shared_guard

    out = tmp_path / "model.onnx"
    with caplog.at_level(logging.WARNING):
        fuse_file(FIXTURES / "llama" / "model.onnx", out, policy=FormPolicy(kv_cache="shared"))
    assert not [r.getMessage() for r in caplog.records if "is not known" in r.getMessage()]
    assert shared_guard(onnx.load(out, load_external_data=False)) is not None
