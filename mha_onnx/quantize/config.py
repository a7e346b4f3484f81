"""What `mha-onnx quantize` is asked to do (weights.py does it): the forms, the knobs and
what each accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mha_onnx.errors import ConfigError

ALGORITHMS = ("rtn", "hqq", "gptq")
WEIGHTS = ("int4", "int8", "w8a8")
EMBEDDINGS = ("float", "int4", "int8")


@dataclass(frozen=True)
class QuantizeConfig:
    """``weights``: int4 | int8 (MatMulNBits) | w8a8 (w8a8.py); ``exclude``: fnmatch
    patterns over MatMul node names and weight names kept float; ``int8``: patterns
    quantized to 8 bits whatever ``weights`` says (the mixed precision of ``--mixed``);
    ``first_last``: the first and last layers' MatMuls in 8 bits; ``embeddings``: the token
    embedding table float or in int4/int8 (GatherBlockQuantized)."""

    weights: str = "int4"
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4
    algorithm: str = "rtn"
    exclude: tuple[str, ...] = ()
    int8: tuple[str, ...] = ()
    first_last: bool = False
    kv_bits: int = 0  # 8: the KV cache in int8 too (kv_cache.py); 0: as it is
    embeddings: str = "float"  # int4 | int8: the token embedding's Gather (embeddings.py)

    def __post_init__(self) -> None:
        if self.kv_bits not in (0, 8):
            raise ConfigError(f"--kv-bits {self.kv_bits}: 8 (an int8 cache per K/V head and "
                              "channel)", hint="a 4-bit cache on ORT's GroupQueryAttention "
                              "measured cosine 0.93-0.95 against the float cache (docs/history/bench-notebook.md):"
                              " not offered")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"--weights {self.weights!r}", hint=" | ".join(WEIGHTS))
        size = self.block_size
        if size < 16 or size & (size - 1):
            raise ConfigError(f"--block-size {size}: MatMulNBits takes a power of 2 >= 16",
                              hint="32 (GenAI's CPU default), 64, 128, ...")
        if not 0 <= self.accuracy_level <= 4:
            raise ConfigError(f"--accuracy-level {self.accuracy_level}: 0 to 4",
                              hint="4: int8 activations on the CPU (GenAI's CPU default)")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"--algorithm {self.algorithm!r}", hint=" | ".join(ALGORITHMS))
        if self.embeddings not in EMBEDDINGS:
            raise ConfigError(f"--embeddings {self.embeddings!r}", hint=" | ".join(EMBEDDINGS))
        if self.algorithm == "gptq" and (self.weights != "int4" or not self.symmetric):
            raise ConfigError("GPTQ writes int4 symmetric blocks", hint="--weights int4 "
                              "--symmetric (int8 rounds finely enough for RTN)")
        if self.algorithm == "hqq" and (self.weights != "int4" or self.int8 or self.first_last):
            raise ConfigError("HQQ quantizes to 4 bits only", hint="--algorithm rtn for int8")

    @property
    def bits(self) -> int:
        return 4 if self.weights == "int4" else 8

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "block_size": self.block_size,
                "symmetric": self.symmetric, "accuracy_level": self.accuracy_level,
                "algorithm": self.algorithm, "exclude": list(self.exclude),
                "int8": list(self.int8), "first_last": self.first_last,
                "kv_bits": self.kv_bits, "embeddings": self.embeddings}


def parse_mixed(specs: tuple[str, ...]) -> tuple[tuple[str, ...], bool, int | str]:
    """--mixed values: (int8 patterns, first/last layers in int8, the most sensitive count
    or "auto")."""
    patterns, first_last, sensitive = [], False, 0
    for spec in specs:
        if spec == "first-last":
            first_last = True
        elif spec == "auto":
            sensitive = "auto"
        elif spec.startswith("sensitive:"):
            try:
                sensitive = int(spec.split(":", 1)[1])
            except ValueError:
                raise ConfigError(f"--mixed {spec!r}", hint="sensitive:N, e.g. sensitive:4"
                                  ) from None
        else:
            patterns.append(spec)
    return tuple(patterns), first_last, sensitive
