"""``mha-onnx export --model DIR``: a Hugging Face folder to a fused, verified ONNX model.

torch.export (dynamic batch, sequence and past axes) writes the interface of
:mod:`mha_onnx.reference.hf`; the graph is fused (unless ``fuse=False``), then validated against
the folder's PyTorch model in float32 (shapes other than the tracing example, and for
decoders a prompt plus 16 decode steps) before anything is written. The metadata records the
folder, task, dtype and the sha256 of its config and weights, so that ``validate OUT.onnx``
rebuilds the PyTorch reference from the folder without ``--reference``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mha_onnx import __version__
from mha_onnx.errors import ConfigError, ExportError, FusionError
from mha_onnx.export.islands import cache_kept_float16, kept_for_task
from mha_onnx.export.options import HfExportConfig, HfExportReport
from mha_onnx.export.overflow import finite_or_refused, overflow_refused
from mha_onnx.graph import metadata
from mha_onnx.graph.copies import copy_model
from mha_onnx.graph.files import prepare_output, write_model
from mha_onnx.profile.memory import give_back_memory
from mha_onnx.reference.hf import (
    DecoderWithPast,
    Seq2SeqParts,
    cache_shape,
    check_decoder,
    check_task,
    decoder_layers,
    describe,
    encoder_outputs,
    fingerprint,
    infer_task,
    is_audio,
    layer_cache_shapes,
    load_module,
    min_samples,
    read_config,
)
from mha_onnx.rewrite.faithful import optimize_faithfully
from mha_onnx.rewrite.policy import FormPolicy

PAST, NEW = "past_sequence_length", "sequence_length"
TOTAL = f"{PAST} + {NEW}"


def _random(seed: int = 0):
    """A torch generator for the example inputs: the same folder exports the same file."""
    import torch

    return torch.Generator().manual_seed(seed)


def _examples(task: str, config: Any, module: Any, dtype: str):
    """(args, dynamic shapes, input names, output names) for torch.export."""
    import torch

    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim(NEW, min=1)
    rng = _random()
    ids = torch.randint(0, int(getattr(config, "vocab_size", 2) or 2), (2, 3), generator=rng)
    if task == "image-feature-extraction":
        size, channels = int(config.image_size), int(config.num_channels)
        pixels = torch.randn(2, channels, size, size, generator=rng).to(getattr(torch, dtype))
        return (pixels,), ({0: batch},), ["pixel_values"], encoder_outputs(module)
    if task == "feature-extraction" and is_audio(config):
        least = min_samples(config)
        samples = torch.export.Dim(NEW, min=least)
        values = torch.randn(2, 4 * least, generator=rng).to(getattr(torch, dtype))
        return ((values, torch.ones(2, 4 * least, dtype=torch.int64)), ({0: batch, 1: samples},) * 2,
                ["input_values", "attention_mask"], ["last_hidden_state"])
    if task == "feature-extraction":
        names = ["input_ids", "attention_mask"]
        args = [ids, torch.ones(2, 3, dtype=torch.int64)]
        if getattr(config, "type_vocab_size", 0) and getattr(config, "type_vocab_size", 0) > 1:
            names.append("token_type_ids")
            args.append(torch.zeros(2, 3, dtype=torch.int64))
        return (tuple(args), tuple({0: batch, 1: seq} for _ in args), names,
                encoder_outputs(module))
    past, total = torch.export.Dim("past", min=1), torch.export.Dim("total", min=2)
    layers = int(config.num_hidden_layers)
    pasts = [torch.randn(2, heads, 5, size, generator=rng).to(getattr(torch, dtype))
             for shape in layer_cache_shapes(module, config)
             for heads, size in (shape[:2], shape[2:])]
    positions = torch.arange(5, 8).expand(2, 3).contiguous()
    args = (ids, torch.ones(2, 8, dtype=torch.int64), positions, *pasts)
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
               tuple({0: batch, 2: past} for _ in pasts))  # *pasts: one element to torch.export
    cache = [f"past_key_values.{n}.{kind}" for n in range(layers) for kind in ("key", "value")]
    outputs = ["logits"] + [f"present.{n}.{kind}" for n in range(layers)
                            for kind in ("key", "value")]
    return args, dynamic, ["input_ids", "attention_mask", "position_ids", *cache], outputs


def _seq2seq_examples(part: str, config: Any, dtype: str):
    """torch.export's (args, dynamic shapes, input names, output names) of an
    encoder-decoder's ``part`` (reference.hf.Seq2SeqParts)."""
    import torch

    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim(NEW, min=1)
    rng = _random()
    ids = torch.randint(0, int(config.vocab_size), (2, 3), generator=rng)
    if part == "encoder":
        return ((ids, torch.ones(2, 3, dtype=torch.int64)), ({0: batch, 1: seq},) * 2,
                ["input_ids", "attention_mask"], ["last_hidden_state"])
    encoded = torch.export.Dim("encoder_sequence_length", min=1)
    past = torch.export.Dim("past", min=1)
    kv, head = cache_shape(config)
    layers = decoder_layers(config)
    pasts = [torch.randn(2, kv, 5, head, generator=rng).to(getattr(torch, dtype))
             for _ in range(2 * layers)]
    hidden = torch.randn(2, 4, int(config.d_model), generator=rng).to(getattr(torch, dtype))
    args = (ids, torch.ones(2, 4, dtype=torch.int64), hidden, *pasts)
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: encoded}, {0: batch, 1: encoded},
               tuple({0: batch, 2: past} for _ in pasts))
    cache = [f"past_key_values.{n}.decoder.{kind}" for n in range(layers)
             for kind in ("key", "value")]
    outputs = ["logits"] + [f"present.{n}.decoder.{kind}" for n in range(layers)
                            for kind in ("key", "value")]
    return (args, dynamic, ["input_ids", "encoder_attention_mask", "encoder_hidden_states",
                            *cache], outputs)


def _torch_export(task: str, config: Any, model: Any, dtype: str, opset: int,
                  part: str | None = None):
    import torch

    if part is not None:  # an encoder-decoder's encoder or decoder
        parts = Seq2SeqParts(model)
        module = parts.encoder if part == "encoder" else parts.decoder
        args, dynamic, inputs, outputs = _seq2seq_examples(part, config, dtype)
    else:
        module = DecoderWithPast(model).module if task == "text-generation-with-past" else model
        args, dynamic, inputs, outputs = _examples(task, config, model, dtype)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic,
                                        opset_version=opset, input_names=inputs,
                                        output_names=outputs, optimize=False, verbose=False)
    except Exception as exc:  # torch.export's own errors, whatever their class
        logging.getLogger(__name__).info("torch.export: %s", exc)  # (all of it under -v)
        raise ExportError(f"torch.export cannot export {config.model_type} for {task}"
                          f"{f' ({part})' if part else ''}: {_cause(exc)}",
                          hint="nothing was written; -v shows torch.export's report") from None
    optimize_faithfully(program.model)  # torch's optimizer would drop an epsilon <= 1e-8
    proto = program.model_proto
    for value in list(proto.graph.input) + list(proto.graph.output):
        for dim in value.type.tensor_type.shape.dim:  # torch.export cannot say past + new
            if dim.dim_param in ("total", "past"):
                dim.dim_param = TOTAL if dim.dim_param == "total" else PAST
    for value in proto.graph.output:  # the presents hold the past and the new positions
        if value.name.startswith("present."):
            value.type.tensor_type.shape.dim[2].dim_param = TOTAL
    return proto


def _cause(exc: BaseException) -> str:
    """The first line of the innermost error torch.onnx wrapped (its own text is pages of
    advice before it), at most 240 characters."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    line = lines[0] if lines else type(exc).__name__
    return f"{type(exc).__name__}: {line}"[:240]


def export_hf(folder: str | Path, output: str | Path, cfg: HfExportConfig,
              progress: Callable[[str], None] = lambda _: None) -> HfExportReport:
    """Export, fuse and validate; write ``output`` (and, for an encoder-decoder, its encoder
    beside it as ``OUT.encoder.onnx``) only when everything passed."""
    started = time.perf_counter()
    folder = Path(folder).resolve()
    output = prepare_output(output, force=cfg.force)
    config = read_config(folder)
    task = infer_task(config) if cfg.task == "auto" else cfg.task
    if cfg.genai and task == "text-generation-with-past":
        from mha_onnx.generate.genai import genai_clash

        genai_clash(output, cfg.force)  # (before the export, not after it)
    check_task(config, task)
    if "with-past" not in task and (cfg.kv_cache == "shared" or cfg.logits == "last"):
        given = "--kv-cache shared" if cfg.kv_cache == "shared" else "--logits last"
        raise ConfigError(f"{given} is for decoders; {config.model_type} is exported for "
                          f"{task}", hint=f"drop {given}")
    seq2seq = task == "text2text-generation-with-past"
    targets = {None: output}
    if seq2seq:  # the decoder (the generation step) at OUT, its encoder beside it
        encoder = prepare_output(output.with_name(f"{output.stem}.encoder{output.suffix}"),
                                 force=cfg.force)
        targets = {"encoder": encoder, "decoder": output}
    progress(f"loading {folder.name} ({config.model_type}, {task}, {cfg.dtype})")
    model = load_module(folder, task, cfg.dtype)
    if task == "text-generation-with-past":
        check_decoder(model, config)
    kept, scopes = kept_for_task(model, task, cfg.keep_float32, progress)
    notes, fused, validations = [], [], []
    with tempfile.TemporaryDirectory(prefix="mha_onnx_hf_") as tmp:
        exported = {part: _export_part(folder, config, model, task, part, cfg, Path(tmp),
                                       progress, kept) for part in targets}
        del model  # fuse and validate hold no PyTorch weights (validate loads its own)
        give_back_memory()
        made = {}
        for part, target in targets.items():
            final, what, validation = _fused_and_validated(exported[part], task, part, cfg,
                                                           Path(tmp), progress,
                                                           scopes.get(part, ""))
            made[final] = target
            fused.append(f"{part}: {what}" if part else what)
            validations.append(validation)
        if cfg.weights != "float":  # each part's weights, measured against it first
            made = _each_quantized(made, cfg, notes, progress)
        for final, target in made.items():  # every part passed: now written
            copy_model(final, target)
    if task == "text-generation-with-past" and cfg.genai:
        from mha_onnx.generate.genai import write_genai_folder

        notes.append(write_genai_folder(output, folder).note())
    if seq2seq:
        notes.append(f"encoder written to {targets['encoder']} (input_ids, attention_mask -> "
                     "last_hidden_state); the decoder takes its last_hidden_state as "
                     "encoder_hidden_states")
    return HfExportReport(str(output), task, "; ".join(fused), validations[-1],
                          time.perf_counter() - started, tuple(notes))


def _each_quantized(made: dict[Path, Path], cfg: HfExportConfig, notes: list[str],
                    progress: Callable[[str], None]) -> dict[Path, Path]:
    """Each part's quantized file -> its target; where one is past the thresholds, the
    float parts (exported and validated: the expensive work) written beside the targets as
    ``NAME.float.onnx`` before the refusal, which names them."""
    from mha_onnx.errors import FusionError

    try:
        return {_quantized(final, cfg, notes, progress): target
                for final, target in made.items()}
    except FusionError as exc:
        kept = []
        for final, target in made.items():
            floated = target.with_name(f"{target.stem}.float{target.suffix or '.onnx'}")
            copy_model(final, floated)
            kept.append(str(floated))
        raise FusionError(f"{exc.message}; the float model kept: {', '.join(kept)}",
                          hint=f"`mha-onnx quantize {kept[-1]} -o ...` takes the thresholds, "
                               "--exclude, --mixed (auto: the fewest weights kept in int8 to "
                               "pass) and --algorithm gptq --calibration TEXT") from exc


def _quantized(final: Path, cfg: HfExportConfig, notes: list[str],
               progress: Callable[[str], None]) -> Path:
    """``final``'s weights in ``cfg.weights`` (as `mha-onnx quantize` with ``cfg``'s block
    size, algorithm, --mixed and calibration; its cache in int8 with ``cfg.kv_bits``), next
    to it; refused (nothing written) past the accuracy thresholds."""
    from mha_onnx.errors import FusionError
    from mha_onnx.quantize.config import parse_mixed
    from mha_onnx.quantize.run import INT8_CACHE_NOTE, quantize_file
    from mha_onnx.quantize.weights import QuantizeConfig

    weights = cfg.weights
    progress(f"quantize the weights to {weights} (measured against the float model)")
    out = final.with_name(f"{final.stem}.{weights}.onnx")
    int8, first_last, sensitive = parse_mixed(cfg.mixed)
    config = QuantizeConfig(weights=weights, block_size=cfg.block_size, kv_bits=cfg.kv_bits,
                            algorithm=cfg.algorithm, int8=int8, first_last=first_last,
                            embeddings=cfg.embeddings)
    report = quantize_file(final, out, config, sensitivity=bool(sensitive), force=True,
                           int8_most_sensitive=0 if sensitive == "auto" else sensitive,
                           mixed_auto=sensitive == "auto",
                           weight_calibration=[list(p) for p in cfg.calibration] or None,
                           progress=lambda line: progress(f"quantize: {line}"))
    if not report.written:
        raise FusionError(f"the {weights} model is past the accuracy thresholds: "
                          f"{'; '.join(report.accuracy.failures())}; it was not written")
    figures = report.accuracy
    weights += f" (the embedding {cfg.embeddings})" if cfg.embeddings != "float" else ""
    notes.append(f"weights in {weights}: {report.sizes[1] / report.sizes[0]:.2f}x the float "
                 f"model's bytes; next token KL {figures.kl_mean:.3g}, top-1 agreement "
                 f"{figures.top1:.3f}" + "".join(f"; {n}" for n in report.notes
                                                 if n.startswith(INT8_CACHE_NOTE))
                 if figures.kl_mean is not None else
                 f"weights in {weights}: {report.sizes[1] / report.sizes[0]:.2f}x the float "
                 "model's bytes")
    return out


def _generation(config: Any, model: Any) -> dict[str, Any]:
    """The HF config's fields a generation loop needs, the token ids as the model's
    generation_config has them (which is what transformers.generate reads)."""
    from mha_onnx.graph.decoder import generation_record

    record = generation_record(config)
    settings = getattr(model, "generation_config", None)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(settings, key, None)
        if value is not None:
            record[key] = value
    return record


def _learned_positions(model: Any) -> bool:
    """Does the model look positions up in a learned table (GPT-2, BART, BERT), which ends at
    max_position_embeddings (rotary and relative positions do not end)?"""
    import torch

    return any(isinstance(m, torch.nn.Embedding) and "relative" not in name.lower()
               and ("position" in name.lower() or name.endswith("wpe"))
               for name, m in model.named_modules())


def _export_part(folder: Path, config: Any, model: Any, task: str, part: str | None,
                 cfg: HfExportConfig, tmp: Path, progress: Callable[[str], None],
                 kept: list[str]) -> Path:
    """One file's torch.export, written in ``tmp`` (its path); nothing of it is held after.
    ``kept``: the modules of a float16 model kept in float32 (recorded)."""
    name = part or "model"
    progress(f"torch.export{f' ({part})' if part else ''}")
    proto = _torch_export(task, config, model, cfg.dtype, cfg.opset, part)
    cache_kept_float16([(o.name, o.type.tensor_type.elem_type) for o in proto.graph.output],
                       kept)
    record = {"folder": str(folder), "task": task, "dtype": cfg.dtype,
              "files": fingerprint(folder), "config": describe(config)}
    if kept:
        record["float32_modules"] = kept
    if part:
        record["part"] = part
    table = getattr(config, "max_position_embeddings", None)  # vision: one per patch
    if table and task != "image-feature-extraction" and _learned_positions(model):
        record["positions"] = int(table)  # validate stays within the table
    values = {"version": __version__, "hf_model": record}
    if task == "text-generation-with-past":  # what a generation loop and GenAI read
        values["generation"] = _generation(config, model)
    metadata.write(proto, values)
    proto.producer_name, proto.producer_version = "mha-onnx", __version__
    if cfg.logits == "last" and part != "encoder":
        if task not in ("text-generation-with-past", "text2text-generation-with-past"):
            raise ConfigError(f"--logits last: {task} has no logits",
                              hint="--logits last is for decoders")
        from mha_onnx.rewrite.last_logits import with_last_logits

        progress("logits of the last position only (checked against the export)")
        proto = with_last_logits(proto)
    exported = tmp / f"{name}.exported.onnx"
    write_model(proto, exported, force=True, external=True)  # (ORT maps the weights in place)
    return exported


def _fused_and_validated(exported: Path, task: str, part: str | None, cfg: HfExportConfig,
                         tmp: Path, progress: Callable[[str], None], scope: str = ""):
    """``exported`` fused and validated against PyTorch; (path in ``tmp``, what fuse made of
    its blocks, the validation report). ``scope``: the part's module in the whole model,
    where its recorded module names start (overflow.py)."""
    from mha_onnx.parity import Tolerance, ValidateConfig, validate_model
    from mha_onnx.rewrite import fuse_file

    name = part or "model"
    final, fused = exported, "not fused (--no-fuse)"
    if cfg.fuse:
        progress("fuse (verified against the export on ORT CPU)")
        final = tmp / f"{name}.fused.onnx"
        shared = cfg.kv_cache == "shared" and part != "encoder"
        try:
            report = fuse_file(exported, final, force=True, atol=cfg.atol, rtol=cfg.rtol,
                               policy=FormPolicy(kv_cache="shared" if shared else "appended"),
                               external=True)  # (validate's sessions map the weights)
        except FusionError as exc:  # (fuse's hint names fuse's options)
            if cfg.dtype == "float16" and "inf" in exc.message:
                overflow_refused(exported, ["the export's outputs"], progress, scope)
            exc.hint = (exc.hint or "").replace("--no-verify writes it anyway", "--no-fuse "
                                                "writes the export unfused")
            raise
        fused = "; ".join(b.said() for b in report.blocks) or "no attention block"
    cached = "with-past" in task and part != "encoder"
    give_back_memory()  # (fuse's models and sessions, before PyTorch's weights load again)
    progress("validate against PyTorch" + (" (16 decode steps)" if cached else ""))
    given = {"*": Tolerance(cfg.atol, cfg.rtol)} if (cfg.atol, cfg.rtol) != (None, None) else {}
    validation = validate_model(final, ValidateConfig(memory_check=False, tolerances=given))
    finite_or_refused(exported, validation, cfg, progress, scope)  # (any cache form)
    if not validation:
        raise FusionError("the exported model differs from the PyTorch model: "
                          + "; ".join(f"{c.output} at {c.case}: {c.stats.max_abs:.3g} (would "
                                      f"need atol {c.stats.needed_atol:.3g})"
                                      for c in validation.failures()[:3]),
                          hint="nothing was written; --no-fuse tells the export from fuse; "
                               "--atol/--rtol set the tolerance")
    return final, fused, validation
