"""Shared fixtures: exported models are cached per session (torch.export is the slow part)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)
logging.getLogger("onnxscript").setLevel(logging.WARNING)
logging.getLogger("onnx_ir").setLevel(logging.WARNING)

from mha_onnx.config import MhaConfig  # noqa: E402

SMALL = MhaConfig(d_model=32, num_heads=4, name="small")


@pytest.fixture(scope="session")
def export_cache(tmp_path_factory: pytest.TempPathFactory):
    """export_cache(config, **kw) -> path of an export of ``config`` (made once per session)."""
    from mha_onnx.export.mha import export_model

    folder = tmp_path_factory.mktemp("exports")
    cache: dict[tuple, Path] = {}

    def get(config: MhaConfig, **kwargs) -> Path:
        key = (config, tuple(sorted(kwargs.items())))
        if key not in cache:
            path = folder / f"m{len(cache)}.onnx"
            export_model(config, path, **kwargs)
            cache[key] = path
        return cache[key]

    return get


@pytest.fixture(scope="session")
def zoo():
    """zoo(name) -> a graph exported from code this project did not write (tests/models.py),
    made once per session."""
    from tests.models import ZOO

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = ZOO[name]()
        return cache[name]

    return get


SLOW_FIXTURES = {"zoo", "export_cache", "hf_folder", "crashing"}  # torch.export behind them
# What else makes a test take seconds (pyproject.toml's markers): what `make test-fast` leaves
# out, by what the test runs rather than by how long it took once.
SLOW_MARKS = ("timing", "models", "transformers")


@pytest.fixture(autouse=True, scope="session")
def _remembered_exports(tmp_path_factory):
    """Exports looked up by what decides them before torch.export runs (tests/export_memo.py):
    the committed ones, then the run's own, shared by the workers. Off in the fast suite,
    where torch.export must not run at all."""
    if os.environ.get("MHA_ONNX_FORBID_TORCH_EXPORT"):
        yield
        return
    from tests import export_memo

    with pytest.MonkeyPatch.context() as patch:
        export_memo.install(patch, _run_exports(tmp_path_factory.getbasetemp()))
        yield


def _run_exports(basetemp: Path) -> Path:
    """The run's own exports: beside the workers' temporary folders (pytest-xdist gives each
    worker one inside the run's), so that they share them; inside the run's otherwise."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "exports"


def pytest_terminal_summary(terminalreporter):
    """How many torch.export runs the committed store did not hold (each took seconds)."""
    factory = getattr(terminalreporter.config, "_tmp_path_factory", None)
    if factory is None or os.environ.get("MHA_ONNX_FORBID_TORCH_EXPORT"):
        return
    from tests import export_memo

    folder = _run_exports(factory.getbasetemp())
    missed = len(list(folder.glob("*.onnx"))) if folder.is_dir() else 0
    if missed:
        terminalreporter.write_line(
            f"{missed} torch.export run(s) were not in tests/fixtures/exports (changed code or "
            f"models, or larger than {export_memo.COMMITTED_BYTES >> 20} MB): `make test-exports` "
            "records them")


@pytest.fixture(autouse=True, scope="session")
def _no_torch_export_in_the_fast_suite():
    """`make test-fast` (MHA_ONNX_FORBID_TORCH_EXPORT=1, slow tests deselected): anything
    that reaches torch.export fails, fixtures of any scope included, so the fast suite stays
    fast and the marks stay true."""
    if not os.environ.get("MHA_ONNX_FORBID_TORCH_EXPORT"):
        yield
        return
    import torch

    def refuse(*_, **__):
        raise AssertionError("torch.export in a test not marked slow")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.export, "export", refuse)
        patch.setattr(torch.onnx, "export", refuse)
        yield


def pytest_collection_modifyitems(config, items):
    """A fast suite (CONTRIBUTING.md, rule 18): what needs torch.export, times models, runs whole
    models end to end or runs transformers is ``slow``, so that ``pytest -m "not slow"``
    runs in under two minutes; ``make test`` runs everything."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) \
                or any(item.get_closest_marker(mark) for mark in SLOW_MARKS):
            item.add_marker(pytest.mark.slow)


HF_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _folders():
    import transformers as tf

    text = dict(vocab_size=99, max_position_embeddings=128, **HF_SMALL)
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **text)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(num_key_value_heads=2, head_dim=8,
                                                            **text)),
        # rms_norm_eps=1e-8: torch.onnx's own optimizer would drop it (NaN on padding tokens)
        "helium": lambda: tf.HeliumForCausalLM(tf.HeliumConfig(num_key_value_heads=2, head_dim=8,
                                                               **text)),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            num_key_value_heads=2, head_dim=8, sliding_window=64, **text)),
        # soft-capped scores with a cache; weights wide and a cap of 2, so that the cap binds
        # (Gemma 2's own 50 never does on random weights: parity would prove nothing)
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
            num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=2.0,
            initializer_range=0.5, **text)),
        # attention sinks on its sliding-window layers, which cache every head (its full
        # layers two), routed experts
        "mimo": lambda: tf.MiMoV2FlashForCausalLM(tf.MiMoV2FlashConfig(
            vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=4, head_dim=16,
            v_head_dim=16, sliding_window=16, eos_token_id=2, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention"])),
        "bert": lambda: tf.BertModel(tf.BertConfig(**text)),
        "vit": lambda: tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, **HF_SMALL)),
        # a learned position table per patch, and no max_position_embeddings
        "siglip": lambda: tf.SiglipVisionModel(tf.SiglipVisionConfig(image_size=32, patch_size=8,
                                                                     **HF_SMALL)),
        # raw samples through strided convolutions: no length below 20 samples runs
        "wav2vec2": lambda: tf.Wav2Vec2Model(tf.Wav2Vec2Config(
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, **HF_SMALL)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)),
        "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(  # learned positions
            vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64,
            decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
            max_position_embeddings=128)),
    }


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """hf_folder(name) -> a save_pretrained folder of a small random model (made once per
    session; tests/export/test_export_hf.py and the first-hour tests)."""
    import torch

    made = {}

    def get(name: str):
        if name not in made:
            torch.manual_seed(0)
            folder = tmp_path_factory.mktemp(name)
            _folders()[name]().save_pretrained(folder)
            made[name] = folder
        return made[name]

    return get


# What nearly every worker imports: imported once before the first test, then kept out of
# the cyclic garbage collector's sweeps (gc.freeze). Every full collection otherwise walks
# PyTorch's, transformers' and ONNX's hundreds of thousands of module-level objects, and the
# code under test collects on purpose (profile.memory.give_back_memory, twice per export):
# 0.2 s a collection, about a tenth of test_generate.py's time. Objects made by the tests
# are not frozen: their cycles are collected as before.
HEAVY_IMPORTS = (
    "torch", "torch.export", "torch.onnx", "onnx", "onnxruntime", "onnx_ir", "onnxscript",
    "transformers", "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert",
    "mha_onnx.cli", "mha_onnx.export.hf", "mha_onnx.rewrite", "mha_onnx.parity",
    "mha_onnx.generate.loop", "mha_onnx.quantize.run",
)


def pytest_collection_finish(session):
    import gc
    import importlib

    if session.config.option.collectonly or not session.items:
        return
    for name in HEAVY_IMPORTS:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
