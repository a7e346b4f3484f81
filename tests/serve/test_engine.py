"""The continuous-batching engine as a library: requests joining and leaving a running batch
get the tokens each gets alone from `generate` (both cache forms, float and int4, several
families), rows are freed by an end, a cancel or a time limit, the queue is bounded, one
request's failure is its own, and a drain ends the rest."""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from mha_onnx.errors import ConfigError, ModelFileError
from mha_onnx.generate.sampling import Sampling
from mha_onnx.serve import Engine, EngineConfig, NotAdmitting, QueueFull, Request
from mha_onnx.serve.requests import CANCELLED, ERROR, LENGTH, SHUTDOWN, TIMEOUT
from tests.servers import alone, fused

pytestmark = pytest.mark.models


def _workload(seed: int, n: int = 12, vocab: int = 120):
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, vocab, size=int(s))]
               for s in rng.integers(2, 40, size=n)]
    return prompts, [int(x) for x in rng.integers(4, 40, size=n)]


def _served(model, prompts, news, max_batch: int = 4, stagger: float = 0.002, chunk: int = 0):
    """Each prompt submitted in turn (``stagger`` seconds apart) to one engine: its tokens."""
    with Engine(model, EngineConfig(max_batch=max_batch, prefill_chunk=chunk)) as engine:
        handles = []
        for prompt, new in zip(prompts, news, strict=True):
            handles.append(engine.submit(Request(tuple(prompt), new)))
            time.sleep(stagger)
        got = [list(h.result(120).tokens) for h in handles]
        assert engine.running == 0 and engine.rows.rows == 0
        return got, engine.steps


@pytest.mark.parametrize("family, form, weights", [
    ("llama", "shared", None), ("llama", "appended", None), ("llama", "shared", "int4"),
    ("llama", "appended", "int4"), ("llama", "shared", "w8a8"), ("qwen3", "shared", None),
    ("gemma3", "appended", None),
    ("gpt2", "shared", None)])
def test_requests_joining_and_leaving_get_their_tokens_alone(tmp_path, family, form, weights):
    """Twelve requests of 2-40 prompt tokens and 4-40 new ones through a batch of 4: rows
    join while others run and leave at their own ends; each gets `generate`'s tokens for it
    alone, its prompt run whole or in chunks of 7 between the steps. (Gemma3's Optimum
    export takes no position_ids: its rows run one at a time, and the engine says why.)"""
    model = fused(family, form, tmp_path / family, weights)
    prompts, news = _workload(zlib.crc32(f"{family}{form}".encode()) % 1000)
    want = alone(model, prompts, news)
    got, steps = _served(model, prompts, news)
    assert got == want
    assert _served(model, prompts, news, chunk=7)[0] == want
    with Engine(model, EngineConfig(max_batch=4)) as engine:
        shared_step = engine.rows.slots > 1
        assert bool(engine.notes) is (family == "gemma3")
        if form == "shared":  # chunks ran with the steps (mixed.py), but for float prompts
            assert (engine.rows.mixer is not None) is (engine.generator.float_prompt is None)
        # the step session's threads spin past its runs unless another session runs between
        assert engine.generator.runner.stop_spinning is (
            engine.rows.mixer is not None or engine.generator.float_prompt is not None)
    if shared_step:  # (rows shared steps: fewer steps than tokens one at a time)
        assert steps < sum(len(w) for w in want) - len(want)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return fused("llama", "shared", tmp_path_factory.mktemp("llama"))


def test_a_cancel_frees_the_row_and_a_time_limit_ends_a_request(llama):
    with Engine(llama, EngineConfig(max_batch=2)) as engine:
        long = engine.submit(Request((5, 6, 7), 200, eos=()))
        next(iter(long))  # running
        long.cancel()
        assert long.result(30).finish_reason == CANCELLED
        assert engine.running == 0 and engine.rows.free() == 2
        late = engine.submit(Request((5, 6, 7), 200, eos=(), timeout=1e-6))
        assert late.result(30).finish_reason == TIMEOUT and not late.result().tokens
        short = engine.submit(Request((5, 6, 7), 3, eos=()))
        assert short.result(30).finish_reason == LENGTH and len(short.result().tokens) == 3


def test_the_queue_is_bounded_and_a_drain_ends_what_is_left(llama):
    engine = Engine(llama, EngineConfig(max_batch=1, max_queue=2))
    try:
        first = engine.submit(Request((5, 6), 250, eos=()))
        next(iter(first))  # the one row taken
        waiting = [engine.submit(Request((5, 6), 250, eos=())) for _ in range(2)]
        with pytest.raises(QueueFull):
            engine.submit(Request((5, 6), 4, eos=()))
        assert engine.queue_depth == 2
        assert not engine.drain(grace=0.05)  # not all ended within the grace
        with pytest.raises(NotAdmitting):
            engine.submit(Request((5, 6), 4))
        ends = {h.result(30).finish_reason for h in [first, *waiting]}
        assert ends <= {SHUTDOWN, LENGTH} and SHUTDOWN in ends
    finally:
        engine.close()


def test_bad_requests_are_refused_before_they_wait(llama):
    with Engine(llama, EngineConfig(max_batch=2, max_length=64)) as engine:
        with pytest.raises(ConfigError, match="outside the vocabulary"):
            engine.submit(Request((5, 999)))
        with pytest.raises(ConfigError, match="need 70 positions, more than the 64"):
            engine.submit(Request((5,) * 10, 60))
        with pytest.raises(ConfigError, match="past the model's 256 positions"):
            Engine(llama, EngineConfig(max_length=4096))
        with pytest.raises(ConfigError):
            Request((), 4)
        assert engine.running == 0 and engine.queue_depth == 0


def test_the_model_failing_on_one_request_fails_that_request_only(llama, monkeypatch):
    """A prompt ORT fails on, alone or in a run with the running rows' step (mixed.py: then
    each runs again alone, and only the prompt's request fails)."""
    with Engine(llama, EngineConfig(max_batch=2)) as engine:
        prefill, mixed = engine.rows.prefill, engine.rows.mixed

        def failing(row, prompt, upto):
            if prompt[0] == 13:
                raise ModelFileError("onnxruntime failed to run the model: boom")
            return prefill(row, prompt, upto)

        def failing_mixed(tokens, row, prompt, upto):
            if prompt[0] == 13:
                raise ModelFileError("onnxruntime failed to run the model: boom")
            return mixed(tokens, row, prompt, upto)

        monkeypatch.setattr(engine.rows, "prefill", failing)
        monkeypatch.setattr(engine.rows, "mixed", failing_mixed)
        good = engine.submit(Request((5, 6, 7), 20, eos=()))
        bad = engine.submit(Request((13, 6, 7), 20, eos=()))
        assert bad.result(30).finish_reason == ERROR and "boom" in bad.result().error
        assert good.result(30).finish_reason == LENGTH and len(good.result().tokens) == 20
        assert engine.alive and engine.submit(Request((5,), 2)).result(30).tokens


def test_a_seed_repeats_a_sampled_request_whatever_runs_beside_it(llama):
    sampled = Request((5, 6, 7), 16, Sampling(True, temperature=1.5, seed=3), eos=())
    with Engine(llama, EngineConfig(max_batch=4)) as engine:
        one = engine.submit(sampled).result(30).tokens
        others = [engine.submit(Request((9, 8), 30, Sampling(True, seed=s), eos=()))
                  for s in range(3)]
        again = engine.submit(sampled).result(30).tokens
        [h.result(30) for h in others]
    assert one == again


def test_a_step_and_a_chunk_in_one_run_give_what_each_gives_alone(llama):
    """The mixed graph (serve/mixed.py) on the shared Llama: the running rows' step logits
    and a joining prompt's chunks equal the step and the chunks run one after the other;
    with mixed_steps off no mixed session is made."""
    from mha_onnx.generate.loop import Generator
    from mha_onnx.serve.mixed import mixed_graph
    from mha_onnx.serve.mixing import _agrees, mixed_runner
    from mha_onnx.serve.rows import SharedRows

    generator = Generator(llama)
    runner = mixed_runner(generator)
    assert runner is not None and _agrees(generator, runner)
    names = {v.name for v in mixed_graph(__import__("onnx").load(llama)).graph.input}
    assert "attention_mask" not in names and "mixed_chunk.past_key_values.0.key" in names
    rows, alone = SharedRows(generator, 4, 40), SharedRows(generator, 4, 40)
    for store in (rows, alone):
        store.join(0, [5, 6, 7, 8])
    rows.mixer = runner
    step, first = rows.mixed(np.array([9]), 1, list(range(10, 22)), 12)
    np.testing.assert_allclose(step, alone.step(np.array([9])), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(first, alone.join(1, list(range(10, 22))), rtol=1e-4, atol=1e-4)
    assert rows.order == alone.order == [0, 1] and rows.length == alone.length
    with Engine(llama, EngineConfig(max_batch=4, mixed_steps=False)) as engine:
        assert engine.rows.mixer is None


def test_a_prompt_runs_whole_with_no_stream_and_in_chunks_beside_streams(llama):
    """--prefill-chunk bounds a turn's prompt positions while rows stream; with no row
    streaming, nobody waits, and a run takes IDLE_CHUNK (here the whole prompt). Tokens stay
    those `generate` gives each request alone."""
    from mha_onnx.generate import GenerationConfig, Generator

    a, b = list(range(10, 30)), list(range(40, 60))
    runs: list[tuple[int, int, int]] = []
    with Engine(llama, EngineConfig(max_batch=4, prefill_chunk=3)) as engine:
        rows = engine.rows
        for name in ("prefill", "mixed"):
            run = getattr(rows, name)

            def recorded(*args, _run=run):
                row, upto = args[-3], args[-1]
                runs.append((row, rows.pending.get(row, 0), upto))
                return _run(*args)
            setattr(rows, name, recorded)
        # both at once: the first's prompt runs alone, then it streams (30 tokens, one a
        # turn) through every chunk of the second's (7 turns), whatever the machine's load
        first = engine.submit(Request(tuple(a), 30, eos=()))
        second = engine.submit(Request(tuple(b), 8, eos=()))
        got = [list(h.result(60).tokens) for h in (first, second)]
    assert runs[0] == (first.id, 0, 20)
    assert [(done, upto) for row, done, upto in runs if row == second.id] == [
        (0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 18), (18, 20)]
    with Generator(llama) as generator:
        assert got == [list(generator.generate([p], GenerationConfig(n, eos=())).sequences[0])
                       for p, n in ((a, 30), (b, 8))]
