"""``mha-onnx export --model DIR``: a Hugging Face folder to a fused, verified ONNX model.

torch.export (dynamic batch, sequence and past axes) writes the interface of
:mod:`mha_onnx.hf_model`; the graph is fused (unless ``fuse=False``), then validated against
the folder's PyTorch model in float32 (shapes other than the tracing example, and for
decoders a prompt plus 16 decode steps) before anything is written. The metadata records the
folder, task, dtype and the sha256 of its config and weights, so that ``validate OUT.onnx``
rebuilds the PyTorch reference from the folder without ``--reference``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mha_onnx import __version__, metadata
from mha_onnx.errors import ConfigError, ExportError, VerifyError
from mha_onnx.graphio import prepare_output, write_model
from mha_onnx.hf_model import (
    TASKS,
    DecoderWithPast,
    cache_shape,
    describe,
    fingerprint,
    infer_task,
    load_module,
    read_config,
)

PAST, NEW = "past_sequence_length", "sequence_length"
TOTAL = f"{PAST} + {NEW}"


@dataclass(frozen=True)
class HfExportConfig:
    task: str = "auto"
    dtype: str = "float32"
    opset: int = 18
    fuse: bool = True
    kv_cache: str = "appended"
    force: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}", hint=f"tasks: {', '.join(TASKS)}")
        if self.dtype not in ("float32", "float16"):
            raise ConfigError(f"unsupported dtype {self.dtype!r}", hint="float32 | float16")
        if self.kv_cache not in ("appended", "shared"):
            raise ConfigError(f"unknown --kv-cache {self.kv_cache!r}", hint="appended | shared")


@dataclass(frozen=True)
class HfExportReport:
    output: str
    task: str
    fused: str  # what fuse made of the blocks, or why not fused
    validation: Any
    seconds: float
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "task": self.task, "fused": self.fused,
                "validation": self.validation.to_dict(), "seconds": round(self.seconds, 2),
                "notes": list(self.notes)}

    def render(self) -> str:
        lines = [f"exported {self.output} ({self.task})", f"  fused: {self.fused}",
                 f"  validated against PyTorch: {len(self.validation.comparisons)} comparisons, "
                 f"passed"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _examples(task: str, config: Any, module: Any, dtype: str):
    """(args, dynamic shapes, input names, output names) for torch.export."""
    import torch

    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim(NEW, min=1)
    ids = torch.randint(0, int(getattr(config, "vocab_size", 2) or 2), (2, 3))
    if task == "image-feature-extraction":
        size, channels = int(config.image_size), int(config.num_channels)
        pixels = torch.randn(2, channels, size, size, dtype=getattr(torch, dtype))
        return (pixels,), ({0: batch},), ["pixel_values"], ["last_hidden_state"]
    if task == "feature-extraction":
        names = ["input_ids", "attention_mask"]
        args = [ids, torch.ones(2, 3, dtype=torch.int64)]
        if getattr(config, "type_vocab_size", 0) and getattr(config, "type_vocab_size", 0) > 1:
            names.append("token_type_ids")
            args.append(torch.zeros(2, 3, dtype=torch.int64))
        return tuple(args), tuple({0: batch, 1: seq} for _ in args), names, ["last_hidden_state"]
    past, total = torch.export.Dim("past", min=1), torch.export.Dim("total", min=2)
    kv, head = cache_shape(config)
    layers = int(config.num_hidden_layers)
    pasts = [torch.randn(2, kv, 5, head, dtype=getattr(torch, dtype)) for _ in range(2 * layers)]
    positions = torch.arange(5, 8).expand(2, 3).contiguous()
    args = (ids, torch.ones(2, 8, dtype=torch.int64), positions, *pasts)
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
               tuple({0: batch, 2: past} for _ in pasts))  # *pasts: one element to torch.export
    cache = [f"past_key_values.{n}.{kind}" for n in range(layers) for kind in ("key", "value")]
    outputs = ["logits"] + [f"present.{n}.{kind}" for n in range(layers)
                            for kind in ("key", "value")]
    return args, dynamic, ["input_ids", "attention_mask", "position_ids", *cache], outputs


def _torch_export(task: str, config: Any, model: Any, dtype: str, opset: int):
    import torch

    module = DecoderWithPast(model).module if task == "text-generation-with-past" else model
    args, dynamic, inputs, outputs = _examples(task, config, model, dtype)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic,
                                        opset_version=opset, input_names=inputs,
                                        output_names=outputs, optimize=True, verbose=False)
    except Exception as exc:  # torch.export's own errors, whatever their class
        text = " ".join(str(exc).split())
        raise ExportError(f"torch.export cannot export {config.model_type} for {task}: "
                          f"{text[:700]}", hint="nothing was written") from None
    proto = program.model_proto
    for value in list(proto.graph.input) + list(proto.graph.output):
        for dim in value.type.tensor_type.shape.dim:  # torch.export cannot say past + new
            if dim.dim_param in ("total", "past"):
                dim.dim_param = TOTAL if dim.dim_param == "total" else PAST
    for value in proto.graph.output:  # the presents hold the past and the new positions
        if value.name.startswith("present."):
            value.type.tensor_type.shape.dim[2].dim_param = TOTAL
    return proto


def export_hf(folder: str | Path, output: str | Path, cfg: HfExportConfig,
              progress: Callable[[str], None] = lambda _: None) -> HfExportReport:
    """Export, fuse and validate; write ``output`` only when everything passed."""
    from mha_onnx.parity import ValidateConfig, validate_model
    from mha_onnx.rewrite import fuse_file

    started = time.perf_counter()
    folder = Path(folder).resolve()
    output = prepare_output(output, force=cfg.force)
    config = read_config(folder)
    task = infer_task(config) if cfg.task == "auto" else cfg.task
    if task == "text2text-generation-with-past":
        raise ConfigError(f"{config.model_type}: encoder-decoder export is not supported yet",
                          hint="export its encoder as feature-extraction, or use Optimum "
                               "(transformers < 4.58) for the decoder files")
    progress(f"loading {folder.name} ({config.model_type}, {task}, {cfg.dtype})")
    model = load_module(folder, task, cfg.dtype)
    progress("torch.export")
    proto = _torch_export(task, config, model, cfg.dtype, cfg.opset)
    metadata.write(proto, {"version": __version__, "hf_model": {
        "folder": str(folder), "task": task, "dtype": cfg.dtype, "files": fingerprint(folder),
        "config": describe(config)}})
    proto.producer_name, proto.producer_version = "mha-onnx", __version__
    with tempfile.TemporaryDirectory(prefix="mha_onnx_hf_") as tmp:
        exported = Path(tmp) / "exported.onnx"
        write_model(proto, exported, force=True)
        final, fused = exported, "not fused (--no-fuse)"
        if cfg.fuse:
            progress("fuse (verified against the export on ORT CPU)")
            final = Path(tmp) / "fused.onnx"
            report = fuse_file(exported, final, force=True,
                               kv_cache="shared" if cfg.kv_cache == "shared" else None)
            fused = "; ".join(f"{b.form}" for b in report.blocks) or "no attention block"
        progress("validate against PyTorch" + (" (16 decode steps)" if "with-past" in task else ""))
        validation = validate_model(final, ValidateConfig(memory_check=False))
        if not validation:
            raise VerifyError("the exported model differs from the PyTorch model: "
                              + "; ".join(f"{c.output} at {c.case}: {c.stats.max_abs:.3g}"
                                          for c in validation.failures()[:3]),
                              hint="nothing was written; --no-fuse tells the export from fuse")
        shutil.copyfile(final, output)
    return HfExportReport(str(output), task, fused, validation, time.perf_counter() - started)
