"""The file ONNX Runtime GenAI runs beside a shared-cache fusion (generate/genai_file.py):
the fusion without its per-layer Ifs, on the fusion's one copy of the weights, written only
where it gives the file's outputs on GenAI's right-padded contract. GenAI's generator on
these folders: tests/generate/test_generate.py."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.generate import genai_file, read_interface
from mha_onnx.generate.genai import deliver_genai, write_genai_folder
from mha_onnx.rewrite import fuse_file
from mha_onnx.rewrite.policy import FormPolicy
from tests.paths import OPTIMUM


def _fused(folder, form: str):
    """The Optimum Llama fused into ``folder`` with GenAI's folder beside it, as `mha-onnx
    fuse` writes them (the fuse report's notes with the delivery's note)."""
    out = folder / "model.onnx"
    folder.mkdir(parents=True, exist_ok=True)
    source = OPTIMUM / "llama" / "model.onnx"
    report = fuse_file(source, out, policy=FormPolicy(kv_cache=form), force=True)
    note = deliver_genai(out, source)
    return out, replace(report, notes=(*report.notes, note))


def _runs(out) -> str:
    config = json.loads((out.parent / "genai_config.json").read_text())
    return config["model"]["decoder"]["filename"]


def _ifs(path) -> int:
    return sum(n.op_type == "If" for n in onnx.load(path, load_external_data=False).graph.node)


@pytest.mark.models
def test_genai_runs_the_shared_fusion_without_its_ifs_on_one_copy_of_its_weights(tmp_path):
    out, report = _fused(tmp_path / "shared", "shared")
    assert _runs(out) == "model.genai.onnx"
    assert any("GenAI runs model.genai.onnx" in n and "model.onnx.data" in n
               for n in report.notes), report.notes
    genai = out.with_name("model.genai.onnx")
    assert _ifs(out) > 0 and _ifs(genai) == 0
    # the weights moved to model.onnx.data, which both files name: stored once
    data = out.with_name("model.onnx.data")
    assert data.stat().st_size > 10 * genai.stat().st_size
    weights = [t for t in onnx.load(genai, load_external_data=False).graph.initializer
               if np.prod(t.dims) * 4 >= 4096]
    assert weights and all(onnx.external_data_helper.uses_external_data(t) for t in weights)
    assert {e.value for t in weights for e in t.external_data if e.key == "location"} == \
        {"model.onnx.data"}
    # what was checked before writing it, now against the written file (its own weights)
    written = onnx.load(out, load_external_data=False)
    assert genai_file.probe_differs(out, written, read_interface(written, out)) == ""


@pytest.mark.models
def test_generate_on_the_genai_file_refuses_a_ragged_batch_and_runs_one_of_one_length(
        tmp_path):
    """The GenAI file takes GenAI's right-padded prompts; generate pads on the left: a
    batch of unequal prompts through it is refused (it gave other tokens silently), prompts
    of one length give the file as written's tokens."""
    from mha_onnx.errors import ConfigError
    from mha_onnx.generate import GenerationConfig, Generator

    out, _ = _fused(tmp_path / "g", "shared")
    genai = out.with_name("model.genai.onnx")
    settings = GenerationConfig(5, eos=())
    with Generator(genai) as generator:
        with pytest.raises(ConfigError, match="unequal prompts on the left"):
            generator.generate([[5, 6, 7, 8], [9, 10]], settings)
        got = generator.generate([[5, 6, 7], [9, 10, 11]], settings).sequences
    with Generator(out) as generator:
        assert generator.generate([[5, 6, 7], [9, 10, 11]], settings).sequences == got


def _logits_off(real):
    """decode_file as it is, its logits then 1% off: a then branch that does not hold."""
    def made(proto):
        graph = real(proto)
        for node in graph.graph.node:
            node.output[:] = ["logits_raw" if o == "logits" else o for o in node.output]
        graph.graph.initializer.append(onnx.numpy_helper.from_array(
            np.array(1.01, np.float32), "one_percent_off"))
        graph.graph.node.append(onnx.helper.make_node("Mul", ["logits_raw", "one_percent_off"],
                                                      ["logits"]))
        return graph
    return made


@pytest.mark.models
def test_where_the_inlined_graph_differs_genai_runs_the_file_as_written(tmp_path, monkeypatch):
    out, _ = _fused(tmp_path / "shared", "shared")
    assert out.with_name("model.genai.onnx").is_file()
    monkeypatch.setattr(genai_file, "decode_file", _logits_off(genai_file.decode_file))
    made = write_genai_folder(out, None)
    assert made.filename == "model.onnx" == _runs(out)
    assert "GenAI runs model.onnx as written" in made.note()
    assert "logits, row 0: max abs error" in made.note()
    assert not out.with_name("model.genai.onnx").exists()  # (the one written before: gone)


@pytest.mark.models
def test_an_appended_cache_gets_no_second_file(tmp_path):
    out, report = _fused(tmp_path / "appended", "appended")
    assert _runs(out) == "model.onnx"
    assert sorted(p.name for p in out.parent.iterdir() if "onnx" in p.name) == ["model.onnx"]
    assert not any("GenAI runs" in n for n in report.notes)


def test_the_probe_is_genai_contract_a_right_padded_prompt_without_past_then_one_step():
    written = onnx.load(OPTIMUM / "llama" / "model.onnx", load_external_data=False)
    iface = read_interface(written, OPTIMUM / "llama" / "model.onnx")
    prompt, step = genai_file.probe_feeds(iface, (5, 2))
    pad = iface.tokens.pad if iface.tokens.pad is not None else iface.tokens.eos[0]
    assert prompt["attention_mask"].tolist() == [[1] * 5, [1, 1, 0, 0, 0]]
    assert (prompt["input_ids"][1, 2:] == pad).all()
    assert prompt["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 0, 0]]
    past = prompt["past_key_values.0.key"]
    assert past.shape[2] == 6 and not past.any()  # zeroed buffers, room for the step
    assert step["input_ids"].shape == (2, 1)
    assert step["attention_mask"].tolist() == [[1] * 6, [1, 1, 0, 0, 0, 1]]
    assert step["position_ids"].tolist() == [[5], [2]]


@pytest.mark.models
def test_the_note_says_a_tokenizer_is_missing_only_where_none_is_beside_the_model(tmp_path):
    out, report = _fused(tmp_path / "shared", "shared")
    assert any("no tokenizer beside it or in the source folder" in n for n in report.notes)
    out.with_name("tokenizer.json").write_text("{}")  # (a quantized copy's folder: already there)
    note = write_genai_folder(out, OPTIMUM / "llama").note()
    assert "tokenizer" not in note.split(";")[0], note


@pytest.mark.models
def test_layers_on_different_guards_keep_the_file_as_written_and_say_so(tmp_path):
    """GPT-Neo's local layers check their window in their guard, its global ones do not:
    no one then branch serves every run, so GenAI is pointed at the file as written."""
    out = tmp_path / "model.onnx"
    fuse_file(OPTIMUM / "gpt_neo" / "model.onnx", out, policy=FormPolicy(kv_cache="shared"))
    proto = onnx.load(out, load_external_data=False)
    made = genai_file.genai_file(out, proto, read_interface(proto, out))
    assert made.filename == "model.onnx"
    assert "by 2 different guards" in made.note
    assert not genai_file.genai_target(out).exists()


@pytest.mark.slow
@pytest.mark.transformers
def test_a_window_wider_than_the_probe_is_probed_past_it(tmp_path):
    """Ministral's window of 64: a right-padded row's step differs past the window (the
    file counts the padding, GroupQueryAttention does not), so the probe's full row runs
    past it (it agreed at 24 tokens, and GenAI got the inlined file)."""
    import torch
    import transformers as tf
    from click.testing import CliRunner

    from mha_onnx.cli import main

    torch.manual_seed(0)
    folder = tmp_path / "ministral"
    tf.MinistralForCausalLM(tf.MinistralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=99, max_position_embeddings=128, num_key_value_heads=2, head_dim=8,
        sliding_window=64, initializer_range=0.2, eos_token_id=98)).save_pretrained(folder)
    out = tmp_path / "out" / "model.onnx"
    result = CliRunner().invoke(main, ["export", "--model", str(folder), "-o", str(out),
                                       "--kv-cache", "shared"])
    assert result.exit_code == 0, result.output
    proto = onnx.load(out, load_external_data=False)
    assert genai_file._window(proto) == 64
    assert _runs(out) == "model.onnx"
    assert "differ on GenAI's right-padded prompt: step:logits, row 1" in result.output


@pytest.mark.models
def test_an_inlined_file_ort_refuses_leaves_the_file_as_written_with_the_reason(
        tmp_path, monkeypatch):
    out, _ = _fused(tmp_path / "shared", "shared")
    real = genai_file.decode_file

    def refused(proto):
        made = real(proto)
        made.graph.node.append(onnx.helper.make_node("NoSuchOp", ["logits"], ["x"]))
        return made

    monkeypatch.setattr(genai_file, "decode_file", refused)
    made = write_genai_folder(out, None)  # (no exception: the export stays written)
    assert made.filename == "model.onnx" == _runs(out)
    assert "ORT could not run the probe" in made.note()


@pytest.mark.models
def test_a_second_decoder_in_one_folder_is_refused_before_it_replaces_genais_config(tmp_path):
    """A folder holds one GenAI model: a second decoder fused into it replaced the first's
    genai_config.json silently; now it is refused before the fusion (exit 2), --force
    replaces it."""
    source = str(OPTIMUM / "llama" / "model.onnx")
    first = CliRunner().invoke(main, ["fuse", source, "-o", str(tmp_path / "a.onnx")])
    assert first.exit_code == 0, first.output
    before = (tmp_path / "genai_config.json").read_text()
    second = CliRunner().invoke(main, ["fuse", source, "-o", str(tmp_path / "b.onnx")])
    assert second.exit_code == 2 and "genai_config.json" in second.output, second.output
    assert "--force" in second.output and not (tmp_path / "b.onnx").exists()
    assert (tmp_path / "genai_config.json").read_text() == before
    forced = CliRunner().invoke(main, ["fuse", source, "-o", str(tmp_path / "b.onnx"),
                                       "--force"])
    assert forced.exit_code == 0, forced.output
    config = json.loads((tmp_path / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "b.onnx"
