"""A quantized decoder's long prompt in float compute (generate/prompt.py): the prompt run
gives what the file at accuracy level 1 gives, a short prompt and the steps what the file
as written gives, in both cache forms; a float file gets no second session."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from mha_onnx.generate import GenerationConfig, Generator, prompt_feeds
from mha_onnx.generate import prompt as float_prompt
from mha_onnx.generate.loop import _BoundRuns
from mha_onnx.graph.walk import attr
from tests.paths import OPTIMUM


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The Optimum Llama fused in both forms, quantized to int4 at levels 4 and 1."""
    from mha_onnx.quantize.weights import QuantizeConfig, quantize_weights
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.policy import FormPolicy

    root = tmp_path_factory.mktemp("float_prompt")
    made = {}
    for form in ("appended", "shared"):
        fused = root / f"{form}.onnx"
        fuse_file(OPTIMUM / "llama" / "model.onnx", fused, policy=FormPolicy(kv_cache=form))
        model = onnx.load(fused)
        for level in (4, 1):
            path = root / f"{form}-level{level}.onnx"
            onnx.save(quantize_weights(model, QuantizeConfig(accuracy_level=level)).model, path)
            made[form, level] = path
        made[form, "float"] = fused
    return made


def _prompt_logits(generator: Generator, prompt: list[int]) -> tuple[np.ndarray, int]:
    iface = generator.interface
    run = _BoundRuns(generator.runner.session, iface, 1, len(prompt) + 4, generator.device,
                     generator._prompt_session(len(prompt)))
    feeds = prompt_feeds([prompt], iface, 0)
    return run(feeds, new=len(prompt), past=0), run.float_prompts


@pytest.mark.models
@pytest.mark.parametrize("form", ["appended", "shared"])
def test_a_long_prompt_runs_in_float_compute_and_the_steps_as_written(quantized, form):
    long = list(np.random.default_rng(0).integers(3, 120, float_prompt.PROMPT_ROWS + 6))
    with Generator(quantized[form, 1]) as level1:
        assert level1.float_prompt is None  # (already float compute)
        want, _ = _prompt_logits(level1, long)
    with Generator(quantized[form, 4], float_prompt=False) as level4:
        as_written, _ = _prompt_logits(level4, long)
        short = level4.generate([long[:20]], GenerationConfig(8, eos=())).sequences
    with Generator(quantized[form, 4]) as generator:
        generator.generate([long[:20]], GenerationConfig(2, eos=()))
        assert generator.prompt_runner is None  # (made for the first long prompt only)
        got, floated = _prompt_logits(generator, long)
        assert floated == 1
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.abs(got - as_written).max() > 1e-4  # (level 4: int8 activations)
        # a short prompt and every step: the file as written
        result = generator.generate([long[:20]], GenerationConfig(8, eos=()))
        assert result.sequences == short and not result.notes
        result = generator.generate([long], GenerationConfig(8, eos=()))
        assert len(result.sequences[0]) == 8
        assert any("float compute" in n for n in result.notes)


@pytest.mark.models
def test_only_a_quantized_file_gets_a_float_prompt_session(quantized, monkeypatch):
    assert float_prompt.float_prompt(quantized["shared", "float"]) is None
    assert float_prompt.float_prompt(quantized["shared", 1]) is None
    monkeypatch.setattr(float_prompt, "SHARED_BYTES", 1)
    made = float_prompt.float_prompt(quantized["shared", 4])
    assert made is not None and made.levels == (4,)
    model = onnx.ModelProto.FromString(made.model)
    from mha_onnx.graph.walk import all_nodes

    nodes = [n for n in all_nodes(model.graph) if n.op_type == "MatMulNBits"]
    assert nodes and all(attr(n, "accuracy_level") == 1 for n in nodes)
    packed = {n.input[1] for n in nodes}
    assert made.initializers and not packed & set(made.initializers)
    assert "model.embed_tokens.weight" in made.initializers


@pytest.mark.models
def test_a_file_with_external_data_is_not_read_whole(quantized, tmp_path):
    """Its data stays on disk for ONNX Runtime to read from the file's folder: the float
    prompt's model is the graph alone, and generates what the same model inline does."""
    path = tmp_path / "model.onnx"
    onnx.save(onnx.load(quantized["shared", 4]), path, save_as_external_data=True,
              location="model.onnx.data", size_threshold=256)
    from onnx.external_data_helper import uses_external_data

    made = float_prompt.float_prompt(path)
    assert made is not None and made.folder == tmp_path.resolve()
    inside = onnx.ModelProto.FromString(made.model).graph.initializer
    assert all(uses_external_data(t) for t in inside if t.name.endswith("_Q4"))
    long = [list(np.random.default_rng(1).integers(3, 120, float_prompt.PROMPT_ROWS + 2))]
    settings = GenerationConfig(6, eos=())
    with Generator(path) as outside, Generator(quantized["shared", 4]) as inline:
        assert outside.generate(long, settings).sequences == \
            inline.generate(long, settings).sequences


@pytest.mark.models
def test_the_cli_says_when_the_prompt_ran_in_float_compute_and_can_run_it_as_written(
        quantized, tmp_path):
    import json

    from click.testing import CliRunner

    from mha_onnx.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([list(range(3, 3 + float_prompt.PROMPT_ROWS))]))
    args = ["generate", str(quantized["shared", 4]), "--prompts", str(prompts),
            "--max-new-tokens", "4", "--json"]
    for extra, floated in (([], True), (["--prompt-as-written"], False)):
        result = CliRunner().invoke(main, args + extra)
        assert result.exit_code == 0, result.output
        notes = json.loads(result.output)["notes"]
        assert any("float compute" in n for n in notes) == floated, notes
