"""What ``export --model`` is asked (HfExportConfig) and what it answers (HfExportReport)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mha_onnx.errors import ConfigError
from mha_onnx.reference.hf import TASKS
from mha_onnx.rewrite.policy import KV_CACHES


@dataclass(frozen=True)
class HfExportConfig:
    task: str = "auto"
    dtype: str = "float32"
    opset: int = 18
    fuse: bool = True
    kv_cache: str = "appended"
    force: bool = False
    genai: bool = True  # text generation: genai_config.json and the tokenizer beside it
    logits: str = "all"  # "last": the LM head of each row's last kept position only
    weights: str = "float"  # int4 | int8 | w8a8: quantized after the export (mha_onnx.quantize)
    atol: float | None = None  # fuse's verification and the check against PyTorch (default:
    rtol: float | None = None  # the dtype's, mha_onnx.stats.DEFAULT_TOLERANCES)
    kv_bits: int = 0  # 8: a shared cache in int8 too (quantize --kv-bits)
    embeddings: str = "float"  # int4 | int8: the token embedding too (quantize --embeddings)
    block_size: int = 32  # quantize's --block-size, --algorithm, --mixed (specs as it takes
    algorithm: str = "rtn"  # them) and --calibration (GPTQ's prompts, token ids)
    mixed: tuple[str, ...] = ()
    calibration: tuple[tuple[int, ...], ...] = ()
    keep_float32: tuple[str, ...] = ()  # float16: modules kept in float32 (export/islands.py)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}", hint=f"tasks: {', '.join(TASKS)}")
        if self.dtype not in ("float32", "float16"):
            raise ConfigError(f"unsupported dtype {self.dtype!r}", hint="float32 | float16")
        if self.kv_cache not in KV_CACHES:
            raise ConfigError(f"unknown --kv-cache {self.kv_cache!r}",
                              hint=" | ".join(KV_CACHES))
        if self.logits not in ("all", "last"):
            raise ConfigError(f"unknown --logits {self.logits!r}", hint="all | last")
        if self.weights not in ("float", "int4", "int8", "w8a8"):
            raise ConfigError(f"--weights {self.weights!r} with --model",
                              hint="int4, int8 or w8a8 (quantized after the export)")
        if self.keep_float32 and self.dtype != "float16":
            raise ConfigError("--keep-float32 keeps modules of a float16 export in float32",
                              hint="--dtype float16 --keep-float32 MODULE")
        if self.weights == "w8a8" and self.dtype != "float32":
            raise ConfigError("--weights w8a8 quantizes a float32 export (ORT's integer GEMM "
                              "gives float32)", hint="--dtype float32, or --weights int4|int8")
        if self.embeddings != "float" and self.weights == "float":
            raise ConfigError("--embeddings quantizes the embedding beside the weights",
                              hint="--weights int4 --embeddings int8")
        self._check_quantizing()
        decoder = self.task in ("auto", "text-generation-with-past")
        if self.kv_bits and (self.weights == "float" or self.kv_cache != "shared"
                             or not self.fuse or not decoder):
            raise ConfigError("--kv-bits quantizes the cache of a decoder exported with "
                              "--kv-cache shared and --weights int4|int8",
                              hint="--model FOLDER --kv-cache shared --weights int4 --kv-bits 8")

    def _check_quantizing(self) -> None:
        """quantize's options refused before the export, not after it (as quantize's
        QuantizeConfig refuses them)."""
        given = [name for name, value in (
            ("--block-size", self.block_size != 32), ("--algorithm", self.algorithm != "rtn"),
            ("--mixed", self.mixed), ("--calibration", self.calibration)) if value]
        if given and self.weights == "float":
            raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for "
                              "the weights quantized after the export",
                              hint="--weights int4 (or int8, w8a8)")
        if self.weights == "float":
            return
        from mha_onnx.quantize.config import QuantizeConfig, parse_mixed

        int8, first_last, _ = parse_mixed(self.mixed)
        QuantizeConfig(weights=self.weights, block_size=self.block_size, kv_bits=self.kv_bits,
                       algorithm=self.algorithm, int8=int8, first_last=first_last,
                       embeddings=self.embeddings)
        if (self.algorithm == "gptq") != bool(self.calibration):
            raise ConfigError("--algorithm gptq takes its activations from --calibration's "
                              "text", hint="--algorithm gptq --calibration PROMPTS.json")


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
        lines = [f"exported {self.output} ({self.task})", f"  fused: {_grouped(self.fused)}",
                 f"  validated against PyTorch: {len(self.validation.comparisons)} comparisons, "
                 f"passed"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _grouped(fused: str) -> str:
    """Each block's form said once with how many blocks took it (a 16-layer decoder's line
    was 16 repeats of one long form); --json keeps every block's."""
    forms = [f for f in fused.split("; ") if f]
    if len(forms) <= 1:
        return fused
    return "; ".join(f"{n} block{'s' if n > 1 else ''}: {form}"
                     for form, n in Counter(forms).items())  # (in the order first met)
