"""`mha-onnx generate` and its library: the next token (greedy, sampled), the prompt's
layout, the decoder interface read from a file, and greedy tokens equal to
transformers.generate for decoders exported by `export --model` (both cache forms) and for
Optimum exports fused (both forms), under our loop and under ONNX Runtime GenAI's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.errors import ConfigError
from mha_onnx.generate import GenerationConfig, Generator, Sampling, prompt_feeds, read_interface
from mha_onnx.generate.decode import shared_guard
from mha_onnx.generate.sampling import next_tokens
from mha_onnx.graph.walk import all_nodes
from mha_onnx.rewrite.policy import FormPolicy
from tests.genai import genai_generate, without_eos
from tests.paths import OPTIMUM
from tests.servers import served

FIXTURES = OPTIMUM
PROMPTS = [[20, 31, 5, 77, 12], [40, 3, 9, 91, 18, 60, 22, 7, 50], [66, 13, 84]]
EQUAL = [[20, 31, 5, 77, 12], [8, 44, 19, 70, 2]]
NEW = 32


# -- the next token ------------------------------------------------------------------------------

def test_greedy_is_the_argmax_and_sampling_keeps_to_top_k_and_top_p():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    assert (next_tokens(logits, Sampling(), rng) == logits.argmax(-1)).all()
    assert (next_tokens(logits, Sampling(True, top_k=1), rng) == logits.argmax(-1)).all()
    assert (next_tokens(logits, Sampling(True, top_p=1e-6), rng) == logits.argmax(-1)).all()
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    draws = np.stack([next_tokens(logits, Sampling(True, top_k=3), rng) for _ in range(200)])
    assert all(set(draws[:, b]) <= set(top3[b]) for b in range(4))
    assert all(len(set(draws[:, b])) > 1 for b in range(4))  # it does sample
    # top-p: the smallest set of most probable tokens holding p of the mass
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    need = int(np.searchsorted(np.cumsum(probs[order]), 0.5) + 1)
    draws = {int(next_tokens(logits[:1], Sampling(True, top_p=0.5), rng)[0]) for _ in range(300)}
    assert draws <= set(order[:need].tolist()) and len(draws) > 1


def test_a_seed_repeats_a_sample_and_the_temperature_sharpens_it():
    logits = np.random.default_rng(1).standard_normal((2, 30)).astype(np.float32)
    one = [next_tokens(logits, Sampling(True), np.random.default_rng(7)) for _ in range(2)]
    assert (one[0] == one[1]).all()
    cold = Sampling(True, temperature=1e-3)
    assert (next_tokens(logits, cold, np.random.default_rng(3)) == logits.argmax(-1)).all()


@pytest.mark.parametrize("bad", [dict(temperature=0), dict(top_k=-1), dict(top_p=0),
                                 dict(top_p=1.5)])
def test_impossible_sampling_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        Sampling(True, **bad)


# -- the contract --------------------------------------------------------------------------------

def test_prompts_are_left_padded_with_positions_over_kept_tokens():
    iface = read_interface(onnx.load(FIXTURES / "llama" / "model.onnx", load_external_data=False),
                           FIXTURES / "llama" / "model.onnx")
    feeds = prompt_feeds([[5, 6, 7], [8]], iface, pad=0)
    assert feeds["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert feeds["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert feeds["position_ids"].tolist() == [[0, 1, 2], [1, 1, 0]]


def test_the_interface_is_read_from_the_file_and_its_folder():
    path = FIXTURES / "llama" / "model.onnx"
    iface = read_interface(onnx.load(path, load_external_data=False), path)
    assert (iface.kv_heads, iface.head_size, iface.vocab, iface.form) == (2, 16, 128, "appended")
    assert len(iface.pasts) == 4 and iface.pasts[0] == ("past_key_values.0.key", "present.0.key")
    assert iface.tokens.eos == (2,) and iface.tokens.source.endswith("llama")  # config.json
    assert not iface.last_logits and iface.position_limit is None
    gpt2 = FIXTURES / "gpt2" / "model.onnx"  # a learned position table bounds the positions
    assert read_interface(onnx.load(gpt2, load_external_data=False), gpt2).position_limit == 256


def test_each_layers_cache_has_its_own_heads():
    """MiMo-V2-Flash's sliding layers cache 4 heads, its full layers 2: the loop's buffers,
    Triton's states and the quantizer's feeds take each past's own shape (the first past's
    for all was refused by ORT at the second layer), and GenAI's config, which takes one
    count, is not written."""
    from onnx import TensorProto, helper

    from mha_onnx.generate.genai import genai_config

    def cache(name, heads):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", heads, "len", 16])

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    pasts = [cache(f"past_key_values.{i}.{kind}", heads) for i, heads in enumerate((4, 2))
             for kind in ("key", "value")]
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 99])
    presents = [cache(p.name.replace("past_key_values", "present"), p.type.tensor_type.shape.dim[1]
                      .dim_value) for p in pasts]
    graph = helper.make_graph([], "decoder", [ids, *pasts], [logits, *presents])
    iface = read_interface(helper.make_model(graph))
    assert [iface.kv_heads_of(p) for p, _ in iface.pasts] == [4, 4, 2, 2]
    assert {iface.head_of(p) for p, _ in iface.pasts} == {16}
    with pytest.raises(ValueError, match="differ in heads"):
        genai_config(iface, "model.onnx", {})


def test_a_decoder_of_more_than_ten_layers_keeps_its_layer_order_and_gets_genai_names():
    """fuse records the cache pairs as JSON with sorted keys (layer 10 before layer 2): read
    back in the inputs' order, and GenAI's name templates written (a 16-layer Llama fused
    got no genai_config.json: "cache names other than past_key_values.N.key/value")."""
    from onnx import TensorProto, helper

    from mha_onnx.generate.genai import _names
    from mha_onnx.graph import metadata

    def cache(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 2, "len", 16])

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    names = [f"past_key_values.{i}.{kind}" for i in range(12) for kind in ("key", "value")]
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 99])
    outputs = [cache(n.replace("past_key_values", "present")) for n in names]
    model = helper.make_model(helper.make_graph([], "decoder", [ids, *map(cache, names)],
                                                [logits, *outputs]))
    metadata.write(model, {"kv_cache": {"form": "appended", "pairs": {
        n: n.replace("past_key_values", "present") for n in names}}})
    recorded = list(json.loads(metadata.read(model)["kv_cache"])["pairs"])
    assert recorded[4] == "past_key_values.10.key"  # (the record's order)
    iface = read_interface(model)
    assert [p for p, _ in iface.pasts] == names
    assert _names(iface.pasts)["past_key_names"] == "past_key_values.%d.key"
    assert _names(iface.pasts[::-1])["present_value_names"] == "present.%d.value"
    assert _names(iface.pasts[1:]) is None  # (a layer's key missing)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_a_model_that_is_not_a_token_decoder_is_refused(family):
    path = sorted((FIXTURES / family).glob("*.onnx"))[-1]
    with pytest.raises(ConfigError, match="not a"):
        read_interface(onnx.load(path, load_external_data=False), path)


# -- tokens equal transformers' ------------------------------------------------------------------

def _hf_folders():
    import transformers as tf

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 vocab_size=99, max_position_embeddings=128,
                 initializer_range=0.2)  # logits far apart: tokens decided by the model, not
    return {  # by float noise at a near-tie
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2,
                                                            eos_token_id=98, **small)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(num_key_value_heads=2, head_dim=8,
                                                            eos_token_id=97, **small)),
        # sliding-window layers, window 16: a prompt and 32 tokens run past it
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            num_key_value_heads=2, head_dim=8, sliding_window=16, **small)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(num_key_value_heads=2, pad_token_id=0,
                                                         eos_token_id=96, **small)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=99, n_positions=128, n_embd=32, n_layer=2, n_head=4,
            initializer_range=0.2, eos_token_id=95, bos_token_id=95)),
        # experts, sinks, a sliding layer caching 4 heads and a full one caching 2
        "mimo": lambda: tf.MiMoV2FlashForCausalLM(tf.MiMoV2FlashConfig(
            vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=4, head_dim=16,
            v_head_dim=16, sliding_window=16, eos_token_id=2, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention"], initializer_range=0.2)),
        # sinks spelt as a scale after the attention, sigmoid(logsumexp - sink)
        "granite_swa": lambda: _random_sinks(tf.GraniteSWAForCausalLM(tf.GraniteSWAConfig(
            num_key_value_heads=2, sliding_window=16, eos_token_id=2, pad_token_id=0,
            bos_token_id=1, layer_types=["sliding_attention", "full_attention"],
            layer_rope_theta=[10000.0, 10000.0], **small))),
    }


def _random_sinks(model):
    """Sinks of either sign, larger than their initial values: each one matters."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    return model


def hf_tokens(model, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    """transformers.generate's greedy tokens, prompts left-padded into one batch; each row up
    to and including an EOS."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None
           and e < model.config.vocab_size]
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new, pad_token_id=0, eos_token_id=eos or None)
    rows = []
    for row in out[:, longest:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        rows.append(row[:cut + 1] if cut is not None else row)
    return rows


def ours(path: Path, prompts, new: int = NEW) -> list[list[int]]:
    with Generator(path) as generator:
        return [list(s) for s in generator.generate(prompts, GenerationConfig(new)).sequences]


def _export(folder: Path, tmp_path: Path, form: str) -> Path:
    """`export --model` into a folder of its own (genai_config.json beside the model)."""
    out = tmp_path / form / "model.onnx"
    out.parent.mkdir()
    result = CliRunner().invoke(main, ["export", "--model", str(folder), "-o", str(out),
                                       "--kv-cache", form])
    assert result.exit_code == 0, result.output
    assert "genai_config.json written" in result.output
    return out


@pytest.fixture(scope="module")
def hf_decoder(tmp_path_factory):
    import torch

    def make(name: str):
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(name)
        _hf_folders()[name]().save_pretrained(folder)
        return folder

    return make


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3", "gpt2"])
def test_export_model_generates_what_transformers_generates(hf_decoder, tmp_path, family):
    """Both cache forms of `export --model`: our loop at batch 1 and at batch 3 with rows
    of different lengths, the serving engine with the rows joining a running batch, and
    GenAI's generator on the folder export writes (genai_config
    and all) alone, as a batch of equal lengths and as a right-padded batch (GenAI pads so;
    each row as alone where the model has no window, the same in both forms)."""
    from mha_onnx.reference.hf import load_module

    folder = hf_decoder(family)
    model = load_module(folder, "text-generation-with-past")
    want1, want3 = hf_tokens(model, PROMPTS[:1]), hf_tokens(model, PROMPTS)
    alone = [hf_tokens(model, [p])[0] for p in PROMPTS]
    assert alone == want3  # (transformers itself: a row's tokens do not depend on the batch)
    equal = hf_tokens(model, EQUAL)
    eos = {model.generation_config.eos_token_id}
    genai: dict[str, list] = {}
    for form in ("appended", "shared"):
        out = _export(folder, tmp_path, form)
        assert ours(out, PROMPTS[:1]) == want1, form
        assert ours(out, PROMPTS) == want3, form
        # served: the rows joining a running batch (mha_onnx.serve), each as alone
        assert served(out, PROMPTS, [NEW] * len(PROMPTS)) == alone, form
        config = json.loads((out.parent / "genai_config.json").read_text())
        assert config["search"]["past_present_share_buffer"] == (form == "shared")
        written = onnx.load(out, load_external_data=False)
        assert [i.name for i in written.graph.input][:3] == \
            ["input_ids", "attention_mask", "position_ids"]  # no past_sequence_length input
        # shared: one guard for every layer (the steps' decode graph); GenAI runs it where it
        # gives the file's outputs on GenAI's right-padded contract (a window: it does not)
        runs = config["model"]["decoder"]["filename"]
        if form == "shared":
            assert shared_guard(written) is not None
            assert runs == ("model.onnx" if family == "gemma3" else "model.genai.onnx")
            genai_graph = onnx.load(out.parent / runs, load_external_data=False).graph
            assert any(n.op_type == "If" for n in genai_graph.node) is (family == "gemma3")
        else:
            assert runs == "model.onnx"
        genai[form] = _genai_runs(out.parent, want3, equal, eos)
    assert genai["appended"] == genai["shared"]
    if genai["appended"] is not None and family != "gemma3":  # (no window: as alone)
        assert genai["appended"] == without_eos(alone, eos)


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.parametrize("family, says", [
    ("granite_swa", "window 16, sinks"),
    ("mimo", "genai_config.json not written: its layers' caches differ")],
    ids=["granite_swa", "mimo"])
def test_sink_families_through_export_model_generate_transformers_tokens(
        hf_decoder, tmp_path, family, says):
    """Our loop at batch 1 and at batch 3 with rows of different lengths gives transformers'
    greedy tokens. Granite SWA's sinks, sigmoid(logsumexp(scores) - sink) times the
    attention's output, go onto GroupQueryAttention's head_sink (they stayed outside the
    kernel, the scores computed a second time for the logsumexp). MiMo-V2-Flash (sinks,
    experts, each layer's cache with its own heads) failed in ORT at the second layer's
    cache, shaped as the first's; GenAI's config, which takes one head count, is not
    written for it."""
    from mha_onnx.reference.hf import load_module

    folder = hf_decoder(family)
    model = load_module(folder, "text-generation-with-past")
    out = tmp_path / family / "model.onnx"
    result = CliRunner().invoke(main, ["export", "--model", str(folder), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert says in result.output
    fused = onnx.load(out, load_external_data=False)
    assert not any(n.op_type == "ReduceLogSumExp" for n in all_nodes(fused.graph))
    assert ours(out, PROMPTS[:1]) == hf_tokens(model, PROMPTS[:1])
    assert ours(out, PROMPTS) == hf_tokens(model, PROMPTS)


def _genai_runs(folder: Path, want3, equal, eos: set) -> list | None:
    """GenAI alone and as an equal-length batch equal transformers; its right-padded batch
    is returned (compared across forms: a window counts the padding between a row's prompt
    and its new tokens as the export does, so only rows without a window equal generating
    alone there)."""
    from tests.genai import genai_python

    if genai_python() is None:
        return None
    alone = genai_generate(folder, PROMPTS, NEW, "each")["sequences"]
    assert alone == without_eos(want3, eos)
    assert genai_generate(folder, EQUAL, NEW, "batch")["sequences"] == without_eos(equal, eos)
    return genai_generate(folder, PROMPTS, NEW, "batch")["sequences"]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3", "gpt2", "gemma",
                                    "qwen3_moe"])
@pytest.mark.transformers
def test_optimum_exports_fused_generate_what_transformers_generated(tmp_path, family):
    """Optimum's export fused in both forms: our tokens equal those transformers generated
    from the same weights when the fixture was made (generate.json, tools/optimum_fixtures.py),
    and the fused folder carries genai_config.json for GenAI (where the model has an EOS
    inside its vocabulary, which GenAI needs), which generates them too."""
    from mha_onnx.generate.genai import deliver_genai
    from mha_onnx.rewrite import fuse_file
    from tests.genai import genai_python

    source = FIXTURES / family
    want = json.loads((source / "generate.json").read_text())
    prompts = want["prompts"]
    assert ours(source / "model.onnx", prompts) == want["batch3"]  # the export itself
    for form in ("appended", "shared"):
        out = tmp_path / form / "model.onnx"
        out.parent.mkdir()
        fuse_file(source / "model.onnx", out, policy=FormPolicy(kv_cache=form))
        note = deliver_genai(out, source / "model.onnx")  # (as `mha-onnx fuse` writes it)
        written = (out.parent / "genai_config.json").exists()
        assert written == bool(want["eos_token_id"]), note
        assert ours(out, prompts[:1]) == want["batch1"], form
        assert ours(out, prompts) == want["batch3"], form
        if written and genai_python() is not None:
            eos = set(want["eos_token_id"])
            # alone; a right-padded batch (a window counts the padding as the export does)
            for mode in ("each", "batch") if family != "gemma3" else ("each",):
                got = genai_generate(out.parent, prompts, NEW, mode)["sequences"]
                assert got == without_eos(want["batch3"], eos), (form, mode)


@pytest.mark.transformers
def test_deepseeks_latent_attention_generates_what_transformers_generated(tmp_path):
    """DeepSeek-V3's MLA (V's heads narrower than Q's and K's: no ORT kernel with past takes
    them) fused with its step over the concatenated cache and its prompt on GQA (V padded
    with zeros): transformers' tokens; a shared cache is refused, saying why."""
    from mha_onnx.errors import ConfigError
    from mha_onnx.rewrite import fuse_file

    source = FIXTURES / "deepseek_v3"
    want = json.loads((source / "generate.json").read_text())
    out = tmp_path / "model.onnx"
    report = fuse_file(source / "model.onnx", out)
    assert all(b.form.startswith("If(one new token): MHA key_padding_mask over the cache")
               and "If(no past): GroupQueryAttention (causal)" in b.form
               for b in report.blocks), report.render()
    assert ours(out, want["prompts"]) == want["batch3"]
    with pytest.raises(ConfigError, match="V's head size is not K's"):
        fuse_file(source / "model.onnx", tmp_path / "shared.onnx",
                  policy=FormPolicy(kv_cache="shared"))


# -- the command line ----------------------------------------------------------------------------

def _cli(*args: str):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_generate_writes_json_with_the_sequences_and_timings(tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    result = _cli(FIXTURES / "llama" / "model.onnx", "--prompts", prompts, "--max-new-tokens",
                  8, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    want = json.loads((FIXTURES / "llama" / "generate.json").read_text())["batch3"]
    assert report["sequences"] == [row[:8] for row in want]
    for key in ("time_to_first_token_ms", "tokens_per_s", "decode_tokens_per_s", "ms_per_step",
                "ort_share", "stopped", "eos_token_id"):
        assert key in report
    assert report["model"]["cache"] == "appended" and report["eos_token_id"] == [2]
    sampled = _cli(FIXTURES / "llama" / "model.onnx", "--prompts", prompts, "--sample",
                   "--top-k", 5, "--seed", 3, "--json")
    again = _cli(FIXTURES / "llama" / "model.onnx", "--prompts", prompts, "--sample",
                 "--top-k", 5, "--seed", 3, "--json")
    assert json.loads(sampled.output)["sequences"] == json.loads(again.output)["sequences"]


def test_text_in_and_out_with_a_tokenizer_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<unk>": 1, "<eos>": 2} | {f"w{n}": n for n in range(3, 128)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(tmp_path / "tok")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["w20 w31 w5 w77 w12", "w66 w13 w84"]))
    result = _cli(FIXTURES / "llama" / "model.onnx", "--prompts", prompts, "--tokenizer",
                  tmp_path / "tok", "--max-new-tokens", 4, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    want = json.loads((FIXTURES / "llama" / "generate.json").read_text())["batch3"]
    assert report["sequences"] == [want[0][:4], want[2][:4]]
    assert report["texts"] == [" ".join(f"w{t}" for t in want[0][:4] if t != 2),
                               " ".join(f"w{t}" for t in want[2][:4] if t != 2)]


@pytest.mark.parametrize("prompts, extra, message", [
    ([], (), "no prompts"),
    ([[1, 2], []], (), "prompt 1 is empty"),
    ([[1, 500]], (), "outside the vocabulary"),
    ([[1, 2, 3]], ("--max-length", 10, "--max-new-tokens", 8), "more than --max-length"),
    ([[5] * 246], (), "position table of 256"),
    ({"a": 1}, (), "not a list"),
    (["some text"], (), "pass --tokenizer"),
    ([[1, 2]], ("--temperature", 0, "--sample"), "--temperature must be > 0"),
], ids=["empty", "empty-row", "vocab", "buffer", "table", "not-a-list", "text", "temperature"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, prompts, extra, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prompts))
    model = FIXTURES / ("gpt2" if message.startswith("position") else "llama") / "model.onnx"
    result = _cli(model, "--prompts", path, *extra)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_a_model_that_is_not_a_decoder_exits_2(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("[[1, 2]]")
    result = _cli(FIXTURES / "bert" / "model.onnx", "--prompts", path)
    assert result.exit_code == 2 and "not a decoder with a KV cache" in result.output
    result = _cli(FIXTURES / "bert" / "model.onnx", "--prompts", tmp_path / "missing.json")
    assert result.exit_code == 2


@pytest.mark.models
def test_a_folder_without_an_eos_in_its_vocabulary_gets_no_genai_config(tmp_path):
    """GenAI needs an eos_token_id inside the vocabulary; a model without one is written
    without genai_config.json, and `fuse` says why."""
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "qwen3", source)
    config = json.loads((source / "config.json").read_text())
    assert config.get("eos_token_id") is None or config["eos_token_id"] >= 128
    result = CliRunner().invoke(main, ["fuse", str(source / "model.onnx"), "-o",
                                       str(tmp_path / "out" / "model.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    assert any("genai_config.json not written" in n and "eos_token_id" in n for n in notes), notes
    assert not (tmp_path / "out" / "genai_config.json").exists()


@pytest.mark.slow
def test_a_float16_decoder_generates_transformers_float32_tokens(hf_decoder, tmp_path):
    """`export --model --dtype float16 --kv-cache shared`: the half-precision cache and
    logits through the same loop, the serving engine and GenAI's (logits far apart: the same
    greedy tokens as the float32 model in transformers)."""
    from mha_onnx.reference.hf import load_module
    from tests.genai import genai_python

    folder = hf_decoder("llama")
    want = hf_tokens(load_module(folder, "text-generation-with-past"), PROMPTS)
    out = tmp_path / "model.onnx"
    result = CliRunner().invoke(main, ["export", "--model", str(folder), "-o", str(out),
                                       "--dtype", "float16", "--kv-cache", "shared"])
    assert result.exit_code == 0, result.output
    with Generator(out) as generator:
        assert generator.interface.kv_dtype == "float16"
        assert [list(s) for s in generator.generate(PROMPTS, GenerationConfig(NEW)).sequences] \
            == want
    assert served(out, PROMPTS, [NEW] * len(PROMPTS)) == want  # rows joining a running batch
    if genai_python() is not None:
        got = genai_generate(tmp_path, PROMPTS, NEW, "batch")["sequences"]
        assert got == without_eos(want, {98})
