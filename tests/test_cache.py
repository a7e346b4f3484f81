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
from onnx import numpy_helper

from mha_onnx.cli import main
from mha_onnx.config import MhaConfig
from mha_onnx.errors import ConfigError
from mha_onnx.graph.inputs import ShapeCase, contract_specs, make_inputs
from mha_onnx.reference.mha import build_reference, run_reference
from mha_onnx.rewrite.check.cases import verification_cases
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
    chain = {"prompt"} | {f"step {n}" for n in range(1, 17)}
    expected = {f"decode {s}" for s in chain}
    if padding:  # a padding mask: a left-padded chain and an unpadded one (the fast branch)
        expected |= {f"decode (no key padded) {s}" for s in chain}
    assert steps == expected


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
    # a step reads every weight too: the four projections of d_model 32, with their biases
    weights = sum(numpy_helper.to_array(t).nbytes
                  for t in onnx.load(export_cache(CFG)).graph.initializer)
    assert first["weight_bytes"] == weights >= 4 * 32 * 32 * 4


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


def test_a_kv_model_profiled_without_decode_runs_prompts_with_nothing_cached(export_cache):
    """Without --decode, a point's length is a prompt's: that many new tokens after an
    empty cache (every length dim set to it would time a chunk after as many cached)."""
    from mha_onnx.profile.feeds import point_feeds, target

    feeds = point_feeds(target(str(export_cache(CFG))), 2, 5)
    pasts = [f for name, f in feeds.items() if "past" in name]
    assert pasts and all(p.shape[2] == 0 for p in pasts)
    assert feeds["query"].shape[:2] == (2, 5)
    result = cli("profile", export_cache(CFG), "--seq-lens", "8", "--iters", "2", "--no-ops")
    assert result.exit_code == 0, result.output


def test_a_shared_cache_model_profiles_prompts_on_its_buffers(export_cache, tmp_path):
    """A --kv-cache shared model's prompt writes its buffers in place from position 0."""
    from mha_onnx.profile.feeds import point_feeds, target

    out = tmp_path / "shared.onnx"
    assert cli("fuse", export_cache(CFG), "-o", out, "--kv-cache", "shared").exit_code == 0
    feeds = point_feeds(target(str(out)), 2, 5)
    assert int(feeds["past_sequence_length"]) == 0
    assert all(f.shape[2] == 5 for name, f in feeds.items() if "past" in name and f.ndim == 4)
    result = cli("profile", out, "--seq-lens", "8", "--iters", "2", "--no-ops", "--json")
    assert result.exit_code == 0, result.output
    point = json.loads(result.output[result.output.index("{"):])["points"][0]
    assert point["seq_len"] == 8 and point["p50_ms"] > 0


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


# -- the shared cache buffer (fuse --kv-cache shared) ------------------------------------------

def _shared(tmp_path, src, *extra):
    out = tmp_path / "shared.onnx"
    result = cli("fuse", src, "-o", out, "--kv-cache", "shared", "--json", *extra)
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output)


def _dims(model):
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}


@pytest.mark.parametrize("padding", [False, True], ids=["plain", "left-padded"])
def test_shared_cache_is_a_max_length_buffer_with_a_length_input(export_cache, tmp_path,
                                                                  padding):
    """The pasts become buffers of max_sequence_length positions, the cached length a new
    input; verified against the appended original at every case (a prompt, one new token,
    new tokens after a past with a batch, padded keys: the general branch). With a padding
    mask input the buffers hold per-row lengths (its padded rows stay on GQA), verified on
    left-padded prompts and steps too, and the cached length is read from the shapes (the
    mask's length minus the new tokens, as ONNX Runtime GenAI feeds a shared buffer): no
    extra input."""
    src = export_cache(CFG.replace(cache_padding=padding))
    out, report = _shared(tmp_path, src)
    (block,) = report["blocks"]
    assert "GroupQueryAttention on a shared cache buffer" in block["form"]
    assert ("per-row lengths" in block["form"]) == padding
    assert report["verification"]["passed"]
    cases = {r["case"] for r in report["verification"]["results"]}
    labels = ["no past (prompt)", "one new token (decode)", "odd"]  # odd: S > 1 after a past
    labels += ["no past (prompt), left-padded rows",
               "one new token (decode), left-padded rows"] if padding else []
    for label in labels:
        assert any(c.startswith(label) for c in cases), (label, cases)
    model = onnx.load(out)
    dims = _dims(model)
    assert dims["past_key"] == dims["present_key"] == ["batch", 4, "max_sequence_length", 8]
    assert ("past_sequence_length" in dims) != padding
    if not padding:
        assert dims["past_sequence_length"] == []
    assert "Concat" not in {n.op_type for n in model.graph.node
                            if any(o in ("present_key", "present_value") for o in n.output)}
    recorded = json.loads(next(p.value for p in model.metadata_props
                               if p.key == "mha_onnx.kv_cache"))
    rows = {"rows": {"input": "key_padding_mask", "zero_is_padded": False}} if padding else {}
    length = "mask - ids" if padding else "past_sequence_length"
    assert recorded == {"form": "shared", "past_dim": "past_seq", **rows, "past_length": length,
                        "pairs": {"past_key": "present_key", "past_value": "present_value"}}


def test_shared_cache_decodes_in_place_against_pytorch_and_the_export(export_cache, tmp_path):
    src = export_cache(CFG)
    out, _ = _shared(tmp_path, src)
    for extra in ((), ("--reference", src)):
        result = cli("validate", out, "--json", *extra)
        assert result.exit_code == 0, result.output
        steps = {c["case"] for c in json.loads(result.output)["comparisons"]}
        assert {"decode prompt", "decode step 16"} <= steps


def test_the_shared_adapter_keeps_one_buffer_over_a_decode(export_cache, tmp_path):
    """A chain feeding back the presents it got runs on the same buffers, written in place
    (the prompt allocates them, no step does); positions past the cache are NaN and never
    reach an output."""
    from mha_onnx.graph import cache as kv
    from mha_onnx.parity.decode import decode_chains
    from mha_onnx.runtime.ort import OrtRunner

    out, _ = _shared(tmp_path, export_cache(CFG))
    model = onnx.load(out)
    specs, pairs = kv.shared_view(model)
    allocated = []
    real = kv.shared_buffers

    def counting(*args, **kwargs):
        allocated.append(args[1])
        return real(*args, **kwargs)

    with OrtRunner(str(out)) as runner:
        adapter = kv.SharedCache(runner, specs, pairs, max_length=30)
        original = OrtRunner(str(export_cache(CFG)))
        kv.shared_buffers = counting
        try:
            chains = decode_chains({"shared": adapter, "appended": original}, specs, pairs, 8)
        finally:
            kv.shared_buffers = real
        buffer = adapter._buffers["past_key"].numpy()
    assert allocated == [30]
    assert np.isnan(buffer[:, :, 7 + 8:]).all() and not np.isnan(buffer[:, :, :7 + 8]).any()
    for _, results, _ in chains:
        for name, want in results["appended"].items():
            np.testing.assert_allclose(results["shared"][name], want, atol=1e-5)


@pytest.mark.parametrize("name", ["cached_gpt2_style", "cached_grouped", "hf_cached_llama",
                                  "hf_cached_xglm"])
def test_shared_cache_on_caches_written_elsewhere(zoo, tmp_path, name):
    """Caches named by nobody's convention (found by structure), grouped K/V, a Hugging
    Face Llama decoder with DynamicCache, its positions and mask computed from the cache's
    length (which must then read past_sequence_length, not the buffer's size), and XGLM's,
    whose caches reach the scores with the heads merged into the batch."""
    src = tmp_path / "src.onnx"
    onnx.save(zoo(name), src)
    out, report = _shared(tmp_path, src)
    assert report["verification"]["passed"] and report["fused"] == 1
    assert "GroupQueryAttention" in ops(onnx.load(out))
    result = cli("validate", out, "--reference", src)
    assert result.exit_code == 0 and "decode step 16" in result.output, result.output


def test_shared_cache_needs_a_cache(export_cache, tmp_path):
    result = cli("fuse", export_cache(CFG.replace(kv_cache=False)), "-o", tmp_path / "x.onnx",
                 "--kv-cache", "shared")
    assert result.exit_code == 2 and "no KV-cache attention" in result.output
    assert not (tmp_path / "x.onnx").exists()


def test_shared_cache_decode_profile_reads_the_cached_positions(export_cache, tmp_path):
    out, _ = _shared(tmp_path, export_cache(CFG))
    result = cli("profile", export_cache(CFG), out, "--decode", "--context", "64", "--iters",
                 "2", "--no-ops", "--interleave", "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.output[result.output.index("{"):])["points"]
    assert [p["cache_bytes"] for p in points] == [2 * 1 * 4 * 64 * 8 * 4] * 2
    # without --decode: prompts of 16 tokens on its buffers (refused before they could be fed)
    result = cli("profile", out, "--seq-lens", "16", "--iters", "1", "--no-ops", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["points"][0]["seq_len"] == 16


def test_the_readme_shared_cache_example_runs_and_matches_the_export(export_cache, tmp_path):
    """The fuse guide's IO-binding loop, run as written on a base-preset export: its outputs equal
    the appended export's over the same prompt and 16 steps, and its buffer holds the cache."""
    from pathlib import Path

    import onnxruntime as ort

    from mha_onnx.config import load_preset

    src = export_cache(load_preset("base").replace(mask="causal", kv_cache=True))
    out, _ = _shared(tmp_path, src)
    readme = (Path(__file__).parents[1] / "docs" / "guide" / "fuse.md").read_text()
    start = readme.index('```python\nimport numpy as np, onnxruntime as ort\n')
    code = readme[start + 10:readme.index("```", start + 10)]
    code = code.replace('"out/kv.shared.onnx"', repr(str(out)))
    code = code.replace("    cached += tokens.shape[1]",
                        "    seen.append((tokens, out))\n    cached += tokens.shape[1]")
    scope = {"seen": []}
    exec(compile(code, "fuse.md", "exec"), scope)  # noqa: S102 - the documented example
    session = ort.InferenceSession(str(src))
    past_key = past_value = np.zeros((1, 8, 0, 64), np.float32)
    for tokens, got in scope["seen"]:
        want, past_key, past_value = session.run(None, {"query": tokens, "past_key": past_key,
                                                         "past_value": past_value})
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert len(scope["seen"]) == 17 and scope["cached"] == 23
    np.testing.assert_array_equal(scope["buffers"]["past_key"].numpy()[:, :, :23], past_key)


def test_grouped_heads_with_a_padding_mask_step_on_gqa_with_past(zoo):
    """A Llama layer with DynamicCache (grouped K/V, an attention_mask): a step whose new
    token every row keeps runs on GQA with past (no heads repeated) and the padding as a
    bias, left-padded rows included; other steps on MHA over the repeated cache;
    verification covers both, at one new token after a past."""
    from mha_onnx.rewrite.check.cases import verification_cases

    original = zoo("hf_cached_llama")
    fused, results = fused_and_checked(original)
    (block,) = results
    assert block.form.startswith("If(one new token, kept in every row): GroupQueryAttention "
                                 "with past + padding bias (presents from it) | If(one new "
                                 "token): MHA key_padding")
    cases = {c.label: c for c in verification_cases(original, results)}
    for label in ("one new token (decode)", "one new token (decode), left-padded rows"):
        assert cases[label].dims["seq"] == 1 and cases[label].dims["past"] > 1
    assert cases["one new token (decode), left-padded rows"].padding == "left"
    graph = ir.from_proto(fused).graph
    assert all(o.producer().op_type == "If" for o in graph.outputs[1:])


def test_verification_runs_past_a_sliding_window(zoo):
    """A form with a window (reach) is verified with a prompt longer than it and a step after
    more cached positions than it (optional: a position table may end first)."""
    from types import SimpleNamespace

    from mha_onnx.rewrite.check.cases import verification_cases
    from mha_onnx.rewrite.forms import NO_PAST, ONE_TOKEN, either

    form = either("one new token", "GroupQueryAttention with past, window 5", "MHA + bias",
                  cases=(ONE_TOKEN, NO_PAST), reach=5)
    cases = {c.label: c for c in verification_cases(zoo("hf_cached_llama"),
                                                    [SimpleNamespace(chosen=form)])}
    prompt = cases["no past (prompt), past the window (5)"]
    step = cases["one new token (decode), past the window (5)"]
    assert prompt.dims["seq"] == 8 and prompt.dims["past"] == 0 and prompt.optional
    assert step.dims["seq"] == 1 and step.dims["past"] == 8 and step.optional


def test_verification_runs_a_prompts_later_chunk_in_one_row(zoo):
    """A form with a branch for a chunk after a past in one row (CHUNK) is verified there:
    one row, no key padded and its past's first keys padded, and past a window with more
    cached positions than it."""
    from types import SimpleNamespace

    from mha_onnx.graph.inputs import input_specs, make_inputs
    from mha_onnx.rewrite.check.cases import verification_cases
    from mha_onnx.rewrite.forms import CHUNK, NO_PAST, ONE_TOKEN, either

    chunk = either("one row", "GroupQueryAttention after the row's kept keys", "MHA + bias",
                   cases=(CHUNK,))
    form = either("one new token", "GroupQueryAttention", chunk, cases=(ONE_TOKEN, NO_PAST),
                  reach=5)
    original = zoo("hf_cached_llama")
    cases = {c.label: c for c in verification_cases(original, [SimpleNamespace(chosen=form)])}
    plain = cases["a chunk after a past (one row, no key padded)"]
    padded = cases["a chunk after a past (one row, its past padded)"]
    windowed = cases["a chunk after a past (one row, no key padded), past the window (5)"]
    for case in (plain, padded, windowed):
        assert case.dims["batch"] == 1 and case.dims["seq"] > 1 and case.dims["past"] > 1
    assert windowed.dims["past"] == 8 and plain.padding == "none"
    mask = make_inputs(input_specs(original), padded)["attention_mask"]
    kept = np.flatnonzero(mask[0])  # the first keys padded, all of them in the past
    assert 0 < kept[0] < padded.dims["past"] and kept.tolist() == list(range(kept[0],
                                                                           mask.shape[1]))
