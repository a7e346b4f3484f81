"""Frozen, self-validating configs for one multi-head attention layer, and the presets.

Dimension letters used across the package: B batch, S query length, T key/value length,
D model dim, H heads, Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha_onnx.errors import ConfigError

ATTENTION_KINDS = ("self", "cross")
MASK_KINDS = ("none", "key-padding", "causal")
DTYPES = ("float32", "float16")
def models_dir() -> Path:
    """The folder holding the preset TOML files (``models/`` beside the package)."""
    override = os.environ.get("MHA_ONNX_MODELS")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "models"


@dataclass(frozen=True)
class MhaConfig:
    """One attention layer: head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i, concat, W^O.

    ``d_k``/``d_v`` default to ``d_model // num_heads``. Causal masks are top-left aligned
    (query i sees keys 0..i, PyTorch's ``is_causal``); key-padding masks use True = padded.
    ``kv_cache`` (causal self-attention): the layer takes the cached keys and values of the
    ``past_seq`` earlier positions and returns them with the new ones appended; query i sits at
    position ``past_seq + i`` and sees keys up to it. ``cache_padding`` adds a key padding
    mask over past + new keys (left-padded batched generation).
    """

    d_model: int = 512
    num_heads: int = 8
    d_k: int = 0
    d_v: int = 0
    bias: bool = True
    attention: str = "self"
    mask: str = "none"
    dtype: str = "float32"
    name: str = "custom"
    kv_cache: bool = False
    cache_padding: bool = False

    def __post_init__(self) -> None:
        for field in ("d_model", "num_heads", "d_k", "d_v"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{field} must be an integer, got {value!r}")
        if self.d_model <= 0:
            raise ConfigError(f"d_model must be positive, got {self.d_model}")
        if self.num_heads <= 0:
            raise ConfigError(f"num_heads must be positive, got {self.num_heads}")
        if self.d_model % self.num_heads != 0:
            raise ConfigError(
                f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}",
                hint="pick num_heads dividing d_model (e.g. 512 and 8)",
            )
        for field in ("d_k", "d_v"):
            value = getattr(self, field)
            if value == 0:
                object.__setattr__(self, field, self.d_model // self.num_heads)
            elif value < 0:
                raise ConfigError(f"{field} must be positive, got {value}")
        if not isinstance(self.bias, bool):
            raise ConfigError(f"bias must be true or false, got {self.bias!r}")
        _check_choice("attention", self.attention, ATTENTION_KINDS)
        _check_choice("mask", self.mask, MASK_KINDS)
        _check_choice("dtype", self.dtype, DTYPES)
        for field in ("kv_cache", "cache_padding"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"{field} must be true or false, got {getattr(self, field)!r}")
        if self.kv_cache and (self.attention != "self" or self.mask != "causal"):
            raise ConfigError("a KV cache needs causal self-attention",
                              hint="use --mask causal (self-attention) with --kv-cache")
        if self.cache_padding and not self.kv_cache:
            raise ConfigError("cache_padding is the key padding of a KV-cache model",
                              hint="use it with --kv-cache")

    @property
    def qk_dim(self) -> int:
        """Width of the stacked query/key projections, H * Dk."""
        return self.num_heads * self.d_k

    @property
    def v_dim(self) -> int:
        """Width of the stacked value projection, H * Dv (the input width of W^O)."""
        return self.num_heads * self.d_v

    @property
    def parameter_count(self) -> int:
        weights = 2 * self.d_model * self.qk_dim + 2 * self.d_model * self.v_dim
        biases = 2 * self.qk_dim + self.v_dim + self.d_model if self.bias else 0
        return weights + biases

    def replace(self, **changes: Any) -> MhaConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MhaConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown config key(s): {', '.join(unknown)}",
                hint=f"known keys: {', '.join(sorted(known))}",
            )
        return cls(**data)


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{field} must be one of {', '.join(choices)}; got {value!r}")


def preset_names() -> list[str]:
    """Names that ``--preset`` accepts: the ``name`` of every models/*.toml."""
    folder = models_dir()
    if not folder.is_dir():
        return []
    return sorted(_read_toml(p).get("name", p.stem) for p in folder.glob("*.toml"))


def load_preset(name: str) -> MhaConfig:
    """The preset called ``name`` (e.g. ``base`` from models/transformer-base.toml)."""
    folder = models_dir()
    for path in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
        data = _read_toml(path)
        if name in (data.get("name"), path.stem):
            data.setdefault("name", name)
            return MhaConfig.from_dict(data)
    known = ", ".join(preset_names()) or f"none found in {folder}"
    raise ConfigError(f"unknown preset {name!r}", hint=f"known presets: {known}")


def load_config_file(path: str | os.PathLike[str]) -> MhaConfig:
    """A config from a TOML or JSON file holding MhaConfig's fields."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
    else:
        data = _read_toml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must hold a table of fields")
    data.setdefault("name", path.stem)
    return MhaConfig.from_dict(data)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output of the export contract: name, element type, named dims."""

    name: str
    dtype: str
    dims: tuple[str | int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}


TOTAL_SEQ = "past_seq + seq_q"  # a KV-cache model's keys: past and new (a dim expression)


def graph_inputs(config: MhaConfig) -> tuple[TensorSpec, ...]:
    """The inputs an export of ``config`` has, in order (the graph contract)."""
    specs = [TensorSpec("query", config.dtype, ("batch", "seq_q", config.d_model))]
    if config.kv_cache:
        h = config.num_heads
        specs += [TensorSpec("past_key", config.dtype, ("batch", h, "past_seq", config.d_k)),
                  TensorSpec("past_value", config.dtype, ("batch", h, "past_seq", config.d_v))]
        if config.cache_padding:
            specs.append(TensorSpec("key_padding_mask", "bool", ("batch", TOTAL_SEQ)))
        return tuple(specs)
    kv_len = "seq_q"
    if config.attention == "cross":
        kv_len = "seq_kv"
        specs.append(TensorSpec("key", config.dtype, ("batch", "seq_kv", config.d_model)))
        specs.append(TensorSpec("value", config.dtype, ("batch", "seq_kv", config.d_model)))
    if config.mask == "key-padding":
        specs.append(TensorSpec("key_padding_mask", "bool", ("batch", kv_len)))
    return tuple(specs)


def graph_outputs(config: MhaConfig) -> tuple[TensorSpec, ...]:
    output = TensorSpec("output", config.dtype, ("batch", "seq_q", config.d_model))
    if not config.kv_cache:
        return (output,)
    h = config.num_heads
    return (output,
            TensorSpec("present_key", config.dtype, ("batch", h, TOTAL_SEQ, config.d_k)),
            TensorSpec("present_value", config.dtype, ("batch", h, TOTAL_SEQ, config.d_v)))
