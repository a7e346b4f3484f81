"""``mha-onnx quantize``: a float model's weights in 4 or 8 bits (weights.py), measured
against the float model before anything is written (accuracy.py), recorded in the
quantized model's metadata; a model past the accuracy thresholds is not written (the
report says where; the command exits 1).

What is measured: a decoder runs a batch of prompts (random ids, ``accuracy.PROMPTS`` x
``PROMPT_LENGTH`` tokens, or the user's --eval-prompts, each cut to the shortest's length) through both models, every output compared (logits and the
cache), the next-token distributions at every position; then both generate greedily from
the prompts' first 16 tokens. Any other model runs generated inputs. Sensitivity: each
weight quantized alone, its logits' KL against the float model's (sensitivity.py: one
float session, a run per weight; ``sensitivity=False`` skips it).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mha_onnx.errors import ConfigError
from mha_onnx.graph import metadata
from mha_onnx.profile.memory import give_back_memory
from mha_onnx.quantize import accuracy, kv_cache
from mha_onnx.quantize.calibrated import Quantizer
from mha_onnx.quantize.feeds import (
    EVAL_LENGTH,
    calibration_batches,
    check_prompts,
    decoder_feeds,
    eval_feeds,
    generic_feeds,
    is_decoder,
    prompt_feeds,
    session_outputs,
)
from mha_onnx.quantize.weights import QuantizeConfig, QuantizedWeights, quantize_weights

log = logging.getLogger(__name__)
INT8_CACHE_NOTE = "the KV cache in int8"  # how the report's note on it begins


@dataclass(frozen=True)
class QuantizeReport:
    source: str
    output: str
    config: QuantizeConfig
    accuracy: accuracy.AccuracyReport
    quantized: dict[str, int]  # MatMul -> bits (0: float)
    sizes: tuple[int, int]  # file bytes: the float model, the quantized one
    written: bool
    seconds: float
    notes: tuple[str, ...] = field(default=())
    trials: tuple[Any, ...] = field(default=())  # --mixed auto's (auto.Trial)

    def __bool__(self) -> bool:
        return self.written and bool(self.accuracy)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "output": self.output, "written": self.written,
                "config": self.config.to_dict(), "matmuls": self.quantized,
                "bytes": {"float": self.sizes[0], "quantized": self.sizes[1]},
                "accuracy": self.accuracy.to_dict(), "seconds": round(self.seconds, 2),
                "notes": list(self.notes),
                **({"mixed_auto": [t.to_dict() for t in self.trials]} if self.trials else {})}

    def render(self) -> str:
        counts = {bits: sum(1 for b in self.quantized.values() if b == bits)
                  for bits in (4, 8, 0)}
        ratio = self.sizes[1] / self.sizes[0] if self.sizes[0] else 0
        verdict = "wrote" if self.written else "did not write"
        form = (f"block {self.config.block_size}, "
                f"{'symmetric' if self.config.symmetric else 'asymmetric'}, "
                f"{self.config.algorithm.upper()}, accuracy level {self.config.accuracy_level}"
                if self.config.weights != "w8a8" else "int8 per weight column and per "
                "activation row (MatMulIntegerToFloat)")
        lines = [f"quantized {self.source} -> {self.output} ({verdict}): {counts[4]} MatMul(s) "
                 f"int4, {counts[8]} int8, {counts[0]} float; {form}; {self.sizes[1] / 1e6:.1f} MB "
                 f"({ratio:.2f}x of {self.sizes[0] / 1e6:.1f} MB) in {self.seconds:.1f} s",
                 "  accuracy against the float model:", *self.accuracy.render("    ")]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class FloatRuns:
    """What the float model gave on the report's inputs (its outputs, its greedy tokens),
    kept by one quantize_file call: --mixed auto and --int8-most-sensitive measure one
    candidate after another against the same float runs (the same inputs: seeded, or the
    same prompts), and each measure would otherwise open the float model's sessions again."""

    outputs: dict[str, np.ndarray] | None = None
    greedy: list | None = None


def measure(float_model: onnx.ModelProto, float_path: str, quant: onnx.ModelProto,
            thresholds: accuracy.Thresholds, *, sensitive: list[str] | None = None,
            config: QuantizeConfig | None = None, prompts: list[list[int]] | None = None,
            by_weight: bool = False, runs: FloatRuns | None = None) -> accuracy.AccuracyReport:
    """The accuracy report of ``quant`` against ``float_model`` (see the module's
    docstring); ``sensitive``: the weights to quantize alone (with ``config``), named in
    the report by their first MatMul (by themselves with ``by_weight``); ``prompts``: a
    decoder's prompts (token ids) instead of random ones; ``runs``: the float model's runs
    of an earlier measure on the same inputs, filled where empty."""
    runs = FloatRuns() if runs is None else runs
    decoder = is_decoder(float_model, float_path)
    if prompts and not decoder:
        raise ConfigError("--eval-prompts are for decoders", hint="leave it out: the model "
                          "runs generated inputs")
    if decoder:
        feeds, prompts = eval_feeds(float_model, float_path, prompts) if prompts else \
            decoder_feeds(float_model, float_path, accuracy.PROMPTS, accuracy.PROMPT_LENGTH,
                           seed=0)
    else:
        feeds, prompts = generic_feeds(float_model, seed=0), None
    if runs.outputs is None:
        runs.outputs = session_outputs(float_path, feeds)
    want = runs.outputs
    got = kv_cache.dequantized(quant, session_outputs(quant, kv_cache.cache_feeds(quant, feeds)))
    errors, figures = accuracy.compare(want, got)
    report = accuracy.AccuracyReport(tuple(errors), figures.get("positions", 0),
                                     figures.get("kl_mean"), figures.get("kl_max"),
                                     figures.get("top1"), thresholds=thresholds)
    if decoder and prompts:
        give_back_memory()  # (the two sessions', before greedy opens two more)
        report = replace(report, **_greedy(float_path, quant,
                                           [p[:accuracy.GREEDY_FROM] for p in prompts], runs))
    if sensitive and "logits" in want and config is not None:
        report = replace(report, sensitivity=_sensitivity(float_model, float_path, quant,
                                                          sensitive, config, feeds,
                                                          want["logits"], by_weight))
    return report


def _greedy(float_path: str, quant: onnx.ModelProto, prompts, runs: FloatRuns
            ) -> dict[str, Any]:
    from mha_onnx.generate import GenerationConfig, Generator

    settings = GenerationConfig(accuracy.NEW_TOKENS, eos=())
    if runs.greedy is None:
        with Generator(float_path) as generator:
            runs.greedy = generator.generate(prompts, settings).sequences
    with tempfile.TemporaryDirectory(prefix="mha_onnx_q_") as tmp:
        path = Path(tmp) / "quantized.onnx"
        onnx.save(quant, path)
        with Generator(path) as generator:
            got = generator.generate(prompts, settings).sequences
    share, same = accuracy.greedy_agreement(runs.greedy, got)
    return {"greedy": share, "greedy_rows": (same, len(prompts)),
            "greedy_tokens": accuracy.NEW_TOKENS}


def _sensitivity(float_model, float_path: str, quant: onnx.ModelProto, weights: list[str],
                 config: QuantizeConfig, feeds, want: np.ndarray, by_weight: bool = False):
    """Each weight quantized alone (sensitivity.py: in one session, fed as the quantized
    model reads it back; a weight that is not the main graph's, in a model of its own with
    every MatMul reading it quantized as ``config`` says); by the first MatMul reading it.
    The session's model is written a tensor at a time and read in place: one from the
    model's bytes held the float model three more times (the copy, its bytes, ORT's)."""
    import onnx_ir as ir

    from mha_onnx.quantize import sensitivity
    from mha_onnx.quantize.weights import read_apart, targets
    from mha_onnx.runtime.ort import OrtRunner

    base = read_apart(float_model)  # (the cut weights' and the tied head's own names)
    readers: dict[str, list[str]] = {}
    for target in targets(base, config):
        readers.setdefault(target.weight, []).append(target.node)
    every = [node for nodes in readers.values() for node in nodes]
    values = sensitivity.read_back(quant, weights)
    overriding = ir.from_proto(base)
    fed = sensitivity.overridable(overriding, [w for w in weights if w in values])
    with tempfile.TemporaryDirectory(prefix="mha_onnx_sensitivity_") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(overriding, path, external_data="model.onnx.data", size_threshold_bytes=1024,
                max_workers=1, max_in_flight_bytes=1 << 26)
        del overriding, base
        give_back_memory()
        with OrtRunner(str(path)) as runner:
            plain = {k: v for k, v in feeds.items() if k in runner.input_names}

            def logits_of(weight: str) -> np.ndarray:
                if weight in fed:
                    return runner.infer({**plain, weight: values[weight]})["logits"]
                alone = replace(config, exclude=tuple(n for n in every
                                                      if n not in readers[weight]),
                                int8=(), first_last=False)
                return session_outputs(quantize_weights(float_model, alone).model,
                                       feeds)["logits"]

            ranked = accuracy.sensitivity(weights, logits_of, want)
    return tuple((w if by_weight else readers[w][0], kl) for w, kl in ranked)


def quantize_file(source: str | Path, output: str | Path, config: QuantizeConfig,
                  thresholds: accuracy.Thresholds = accuracy.Thresholds(), *,
                  sensitivity: bool = True, int8_most_sensitive: int = 0, check: bool = True,
                  force: bool = False, calibration: list[list[int]] | None = None,
                  prompts: list[list[int]] | None = None, mixed_auto: bool = False,
                  weight_calibration: list[list[int]] | None = None,
                  progress: Callable[[str], None] = lambda _: None) -> QuantizeReport:
    """Quantize ``source`` into ``output``: written only when its accuracy passes (or
    ``check`` is False); ``int8_most_sensitive``: that many of the most sensitive MatMuls in
    8 bits (sensitivity measured first); ``mixed_auto``: the fewest of them kept wider for
    the thresholds to pass (auto.py); ``calibration``: token-id prompts whose cache sets
    an int8 cache's scales (``config.kv_bits``); ``prompts``: what the accuracy is measured
    on (a decoder's; random ids where None); ``weight_calibration``: token-id prompts
    GPTQ's activations come from (``config.algorithm`` gptq)."""
    from mha_onnx.graph.files import prepare_output, write_model

    started = time.perf_counter()
    output = prepare_output(output, force=force)
    model, source_bytes = _read_with_bytes(source)
    if config.kv_bits:
        kv_cache.require_shared(model)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    make = Quantizer(model, (lambda: calibration_batches(model, str(source), weight_calibration))
                     if weight_calibration else None, progress)
    first = make(config)  # (refuses a quantized model, one without MatMul)
    names = list(dict.fromkeys(t.weight for t in first.targets if t.bits))  # (weights)
    notes = list(first.notes)
    search, runs = None, FloatRuns()
    if int8_most_sensitive or mixed_auto:
        config, search, note = _widened(model, str(source), first, make, config, thresholds,
                                        int8_most_sensitive, prompts, progress, runs)
        first = make(config)
        notes = [*first.notes, note]  # (the notes of the model written)
    if config.kv_bits:
        notes.append(_int8_cache(model, str(source), first.model, calibration))
    give_back_memory()  # (the copies quantizing made and dropped, before sessions open)
    report = measure(model, str(source), first.model, thresholds,
                     sensitive=names if sensitivity else None, config=config, prompts=prompts,
                     runs=runs)
    if prompts:
        notes.append(f"accuracy measured on {len(prompts)} --eval-prompts prompt(s) of "
                     f"{report.positions // len(prompts)} tokens")
    write = not check or bool(report)
    size = 0
    give_back_memory()  # (the measuring sessions', before the model is written)
    if write:
        _record(first, config, report, source, prompts)
        size = _bytes(write_model(first.model, output, force=force))
        notes += _genai(source, output)
    if not write:
        notes.append("past the accuracy thresholds: nothing was written (--mixed auto keeps "
                     "the fewest sensitive MatMuls in int8; or --exclude them, int8, "
                     "--algorithm gptq --calibration TEXT, a smaller --block-size, or loosen "
                     "the thresholds; --no-check writes it anyway)")
    return QuantizeReport(str(source), str(output), config, report, first.matmuls(),
                          (source_bytes, size or first.model.ByteSize()),
                          write, time.perf_counter() - started, tuple(notes),
                          search.trials if search else ())


def _widened(model: onnx.ModelProto, source: str, first: QuantizedWeights, make: Quantizer,
             config: QuantizeConfig, thresholds: accuracy.Thresholds, count: int, prompts,
             progress: Callable[[str], None], runs: FloatRuns):
    """(config, search, note): ``config`` with the ``count`` most sensitive weights in int8,
    or (``count`` 0) with the fewest kept wider for ``thresholds`` to pass (auto.py's
    search; None for a count). The note names each weight by its first MatMul."""
    from mha_onnx.quantize import auto

    reader: dict[str, str] = {}
    for target in first.targets:
        if target.bits:
            reader.setdefault(target.weight, target.node)
    progress(f"ranking {len(reader)} weight(s) by their accuracy, each quantized alone")
    report = measure(model, source, first.model, thresholds, sensitive=list(reader),
                     config=config, prompts=prompts, by_weight=True, runs=runs)
    ranked = [name for name, _ in report.sensitivity]
    if count:
        chosen = ranked[:count]
        return (auto.widened(config, "int8", chosen), None,
                f"int8 for the {len(chosen)} most sensitive MatMul(s): "
                + ", ".join(reader[w] for w in chosen))

    def trial(wider: QuantizeConfig) -> accuracy.AccuracyReport:
        return measure(model, source, make(wider).model, thresholds, prompts=prompts,
                       runs=runs)

    search = auto.least(config, ranked, report, trial, progress)
    return search.config, search, search.note(reader.__getitem__)


def _int8_cache(model: onnx.ModelProto, path: str, quant: onnx.ModelProto,
                calibration: list[list[int]] | None) -> str:
    """``quant``'s cache in int8 (kv_cache.py), its scales from ``model``'s presents over
    ``calibration`` (each prompt a run of its own), else over random prompts (other than
    the report's: seed 1)."""
    from mha_onnx.generate import read_interface
    from mha_onnx.graph.cache import cache_pairs

    pairs = cache_pairs(model)
    if calibration:
        iface = read_interface(model, path)
        check_prompts(iface, calibration)
        runs = [prompt_feeds(iface, [prompt]) for prompt in calibration]
        source = f"{len(calibration)} calibration prompt(s)"
    else:
        runs = [decoder_feeds(model, path, accuracy.PROMPTS, accuracy.PROMPT_LENGTH,
                               seed=1)[0]]
        source = (f"{accuracy.PROMPTS} random prompts of {accuracy.PROMPT_LENGTH} tokens; "
                  "--kv-calibration PROMPTS.json for text like the model's")
    scales = [kv_cache.calibrate(session_outputs(path, feeds), pairs) for feeds in runs]
    kv_cache.quantize_cache(quant, {p: np.max([s[p] for s in scales], axis=0) for p in pairs})
    return (f"{INT8_CACHE_NOTE} per K/V head and channel, its scales from the float "
            f"model's cache over {source}: past and present buffers are int8, ORT's "
            "GroupQueryAttention reads and writes them")


def _read_with_bytes(path: str | Path) -> tuple[onnx.ModelProto, int]:
    """The model at ``path`` (as read_model reads it) and its bytes with its external data
    files, counted before the weights are read in (parsing the file again to count them
    held two more copies of an inline model at the end of the run)."""
    from mha_onnx.graph.files import check_structure, load_external, read_model

    model = read_model(path, load_external_data=False)
    size = _bytes(Path(path), model)
    load_external(model, path)
    check_structure(model, path)
    return model, size


def _bytes(path: Path, model: onnx.ModelProto | None = None) -> int:
    """A model file's bytes with its external data files (``model``: the file read without
    its external data, where at hand)."""
    from mha_onnx.graph.files import external_files, read_model

    files = external_files(model if model is not None
                           else read_model(path, load_external_data=False), path)
    return path.stat().st_size + sum(f.stat().st_size for f in files if f.is_file())


def _record(made: QuantizedWeights, config: QuantizeConfig, report: accuracy.AccuracyReport,
            source: str | Path, prompts: list[list[int]] | None = None) -> None:
    """What was quantized how, its accuracy, the prompts it was measured on (where given:
    ``validate`` measures on them again) and the float model it came from (so that
    ``validate`` finds it again, and knows when it changed)."""
    source = Path(source).resolve()
    given = {"eval_prompts": [p[:EVAL_LENGTH] for p in prompts]} if prompts else {}
    metadata.write(made.model, {"quantization": {
        **made.record(config), "accuracy": report.to_dict(), "source": str(source),
        "source_sha256": _sha256(source), **given}})


def _sha256(path: Path) -> str:
    """The file's SHA-256, read a block at a time (not the whole file at once)."""
    import hashlib

    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _genai(source: str | Path, output: Path) -> list[str]:
    """A GenAI folder beside ``output`` where the source's had one."""
    folder = Path(source).resolve().parent
    if not (folder / "genai_config.json").is_file():
        return []
    from mha_onnx.generate.genai import write_genai_folder

    return [write_genai_folder(output, folder).note()]
