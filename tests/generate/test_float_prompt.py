"""A quantized decoder's long prompt in float compute (generate/prompt.py): the prompt run
gives what the file at accuracy level 1 gives, a short prompt and the steps what the file
as written gives, in both cache forms; a float file gets no second session."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from mha_onnx.generate import GenerationConfig, Generator, prompt_feeds
from mha_onnx.generate import decode as decode_graph_module
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
    with Generator(quantized[form, 4], float_prompt=True) as generator:
        generator.generate([long[:20]], GenerationConfig(2, eos=()))
        # appended: made for the first long prompt only; shared: every prompt runs there,
        # the steps through the decode graph (test_decode_graph_*)
        assert (generator.prompt_runner is None) is (form == "appended")
        assert generator.steps_only is (form == "shared")
        got, floated = _prompt_logits(generator, long)
        assert floated == 1
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.abs(got - as_written).max() > 1e-4  # (level 4: int8 activations)
        result = generator.generate([long[:20]], GenerationConfig(8, eos=()))
        if form == "appended":  # a short prompt and every step: the file as written
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
    with Generator(path, float_prompt=True) as outside, \
            Generator(quantized["shared", 4], float_prompt=True) as inline:
        assert outside.float_prompt is not None and outside.steps_only
        assert outside.generate(long, settings).sequences == \
            inline.generate(long, settings).sequences


@pytest.mark.models
def test_the_cli_says_when_the_prompt_ran_in_float_compute_and_can_run_it_as_written(
        quantized, tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from mha_onnx.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([list(range(3, 3 + float_prompt.PROMPT_ROWS))]))
    monkeypatch.setattr(float_prompt, "fast_int8", lambda: False)  # (as on a CPU without VNNI)
    args = ["generate", str(quantized["shared", 4]), "--prompts", str(prompts),
            "--max-new-tokens", "4", "--json"]
    for extra, floated in (([], True), (["--prompt-as-written"], False)):
        result = CliRunner().invoke(main, args + extra)
        assert result.exit_code == 0, result.output
        notes = json.loads(result.output)["notes"]
        assert any("float compute" in n for n in notes) == floated, notes


def _same_step(full, decode, feeds: dict, buffers: dict) -> None:
    """One step of each from copies of one cache: the same logits, the same cache after."""
    names = [o.name for o in decode.get_outputs()]
    want = full.run(None, {**feeds, **{k: v.copy() for k, v in buffers.items()}})
    got = decode.run(None, {**feeds, **{k: v.copy() for k, v in buffers.items()}})
    assert bool(got[names.index(decode_graph_module.GUARD)])
    for name, a, b in zip(names[:len(want)], want, got, strict=False):
        np.testing.assert_array_equal(b, a, err_msg=name)


@pytest.mark.models
@pytest.mark.parametrize("weights", ["float", 4])
def test_decode_graph_steps_as_the_file_does_and_its_guard_refuses_other_runs(quantized, weights):
    """Every If taken apart for its fast branch, the guard left as an output: a step of one
    kept token per row (rows left-padded or not) gives the file's outputs bit for bit; five
    new tokens is no step of a generation loop, and the guard says so."""
    from mha_onnx.runtime.ort import OrtRunner

    model = onnx.load(quantized["shared", weights])
    decode = decode_graph_module.decode_graph(model)
    assert decode is not None and not [n for n in decode.graph.node if n.op_type == "If"]
    assert len(decode.graph.node) < len(model.graph.node) + 8  # (the guards' nodes shared)
    full = OrtRunner(model.SerializeToString(), "cpu").session
    steps = OrtRunner(decode.SerializeToString(), "cpu").session
    rng = np.random.default_rng(3)
    for batch, pad in ((1, 0), (3, 4)):
        past = 12
        mask = np.ones((batch, past + 1), np.int64)
        for b in range(batch):
            mask[b, :pad * b // 2] = 0  # (row b left-padded by pad*b/2 positions)
        kept = mask[:, :past].sum(1)
        feeds = {"input_ids": rng.integers(3, 100, (batch, 1)), "attention_mask": mask,
                 "position_ids": kept[:, None]}
        buffers = {i.name: rng.standard_normal([batch, 2, 32, 16]).astype(np.float32)
                   for i in full.get_inputs() if i.name.startswith("past")}
        _same_step(full, steps, feeds, buffers)
    feeds = {"input_ids": rng.integers(3, 100, (1, 5)), "attention_mask": np.ones((1, 17),
             np.int64), "position_ids": np.arange(12, 17)[None]}
    out = steps.run([decode_graph_module.GUARD], {**feeds, **{
        k: v[:1] for k, v in buffers.items()}})
    assert not bool(out[0])


@pytest.mark.models
def test_decode_graph_generates_what_the_steps_as_written_do(quantized, monkeypatch):
    """The generator's steps through the decode graph: the tokens of the same generator
    with its steps through the file as written; a step its guard refuses is an error."""
    from mha_onnx.errors import ModelFileError

    prompts = [list(np.random.default_rng(2).integers(3, 120, n)) for n in (70, 40, 66)]
    settings = GenerationConfig(10, eos=())
    with Generator(quantized["shared", 4], float_prompt=True) as generator:
        got = generator.generate(prompts, settings)
        assert any("fast form alone" in n for n in got.notes)
        run = _BoundRuns(generator.runner.session, generator.interface, 1, 50,
                         generator.device, generator._prompt_session(1), steps_only=True)
        run(prompt_feeds([prompts[1]], generator.interface, 0), new=40, past=0)
        two = {**prompt_feeds([[5, 6]], generator.interface, 0),
               "attention_mask": np.ones((1, 42), np.int64), "position_ids": np.array([[40, 41]])}
        with pytest.raises(ModelFileError, match="guard is false"):
            run(two, new=2, past=40)
    monkeypatch.setattr(decode_graph_module, "decode_graph", lambda model: None)
    with Generator(quantized["shared", 4], float_prompt=True) as as_written:
        assert not as_written.steps_only
        want = as_written.generate(prompts, settings)
    assert got.sequences == want.sequences
    assert not any("fast form alone" in n for n in want.notes)


@pytest.mark.models
@pytest.mark.parametrize("fast", [False, True])
def test_the_prompt_runs_in_float_compute_only_where_the_cpu_has_no_fast_int8(
        quantized, monkeypatch, fast):
    """Where a level-4 prompt is faster than float compute (``fast_int8``: docs/history/bench-notebook.md)
    one session, the file as written; elsewhere the float prompt's session, and a
    shared-cache fusion's steps on its decode graph."""
    monkeypatch.setattr(float_prompt, "fast_int8", lambda: fast)
    long = [list(np.random.default_rng(4).integers(3, 120, float_prompt.PROMPT_ROWS + 1))]
    for form in ("shared", "appended"):
        with Generator(quantized[form, 4]) as generator:
            assert (generator.float_prompt is None) is fast
            assert generator.steps_only is (form == "shared" and not fast)
            notes = generator.generate(long, GenerationConfig(3, eos=())).notes
            assert any("float compute" in n for n in notes) is not fast
    with Generator(quantized["shared", 4], float_prompt=True) as asked:  # (whatever the CPU)
        assert asked.float_prompt is not None and asked.steps_only
    with Generator(quantized["shared", 4], float_prompt=False) as as_written:
        assert as_written.float_prompt is None and not as_written.steps_only


def _cpuinfo(vendor: str, flags: str) -> str:
    return f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu sse2 avx2 {flags}\n\n"


def test_only_an_amd_cpu_with_avx512_vnni_keeps_the_prompt_as_written():
    """Where level 4 read a 1024-token prompt faster than float32 (AMD EPYC with AVX-512
    VNNI, 0.79-0.81x) and where it did not (AMD EPYC without VNNI 1.24-1.29x; Intel Xeon
    with AMX and AVX-512 VNNI 1.24-1.35x, level 1 1.06x: docs/history/bench-notebook.md)."""
    assert float_prompt.fast_int8(_cpuinfo("AuthenticAMD", "avx512f avx512_vnni"))
    assert not float_prompt.fast_int8(_cpuinfo("AuthenticAMD", "avx512f"))
    assert not float_prompt.fast_int8(_cpuinfo("GenuineIntel", "avx512f avx512_vnni amx_tile"))
    assert not float_prompt.fast_int8(_cpuinfo("GenuineIntel", "avx512f avx512_vnni"))
    assert not float_prompt.fast_int8("")  # (a CPU that does not say: the float prompt)


def test_the_cpu_is_read_once_for_its_vendor_and_its_isa(monkeypatch):
    """fast_int8 without a text reads /proc/cpuinfo's once and asks both questions of it
    (it read the file once per question)."""
    from mha_onnx.runtime import machine

    reads = []
    monkeypatch.setattr(machine, "cpuinfo_text", lambda: reads.append(1) or _cpuinfo(
        "AuthenticAMD", "avx512f avx512_vnni"))
    assert float_prompt.fast_int8()
    assert len(reads) == 1
