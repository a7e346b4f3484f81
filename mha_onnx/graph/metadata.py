"""What mha-onnx records in a model's ``metadata_props`` and reads back, in one place:
the export's config, version, weights checksum and parameter locations, the fusion summary,
and the ONNX Runtime session options a model needs. Also the small check record that
export and validate report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import onnx

from mha_onnx.config import MhaConfig
from mha_onnx.errors import MhaOnnxError, ModelFileError

PREFIX = "mha_onnx."
JSON_KEYS = ("config", "params", "fusion", "session", "kv_cache", "tuning", "hf_model", "packed",
             "generation", "logits", "quantization")


@dataclass(frozen=True)
class CheckResult:
    """One named check with its outcome and a one-line detail."""

    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def read(model: onnx.ModelProto) -> dict[str, str]:
    """mha-onnx's metadata of ``model``, keys without the prefix, values as stored."""
    return {p.key[len(PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(PREFIX)}


def decoded(model: onnx.ModelProto) -> dict[str, Any]:
    """Like :func:`read`, with the JSON values decoded (for inspect and reports)."""
    out: dict[str, Any] = {}
    for key, value in read(model).items():
        if key == "original_weights":
            continue
        if key == "original":  # (the original kept: its size only)
            out[key] = f"kept for `mha-onnx tune` to tune again ({len(value):,} bytes)"
            continue
        try:
            out[key] = json.loads(value) if key in JSON_KEYS else value
        except json.JSONDecodeError:
            out[key] = value
    return out


def write(model: onnx.ModelProto, values: dict[str, Any], *, keep_others: bool = True) -> None:
    """Set mha-onnx keys (dicts and lists stored as JSON); other props are kept unless
    ``keep_others`` is False (then only these keys remain)."""
    kept = [(p.key, p.value) for p in model.metadata_props
            if keep_others and not (p.key.startswith(PREFIX) and p.key[len(PREFIX):] in values)]
    del model.metadata_props[:]
    for key, value in kept:
        model.metadata_props.add(key=key, value=value)
    for key, value in values.items():
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        model.metadata_props.add(key=PREFIX + key, value=text)


def damaged(key: str, why: object) -> ModelFileError:
    return ModelFileError(f"the model's metadata {PREFIX}{key} is damaged ({why})",
                          hint="re-export the model, or remove mha-onnx's metadata_props")


def loaded(model: onnx.ModelProto, key: str, kind: type = dict) -> Any:
    """The JSON value of ``key`` (None if absent); a value that is not valid JSON of ``kind``
    is a ModelFileError, not a crash."""
    text = read(model).get(key)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise damaged(key, exc) from exc
    if not isinstance(value, kind):
        raise damaged(key, f"a {type(value).__name__}, not a {kind.__name__}")
    return value


def config_of(model: onnx.ModelProto) -> MhaConfig | None:
    """The mha-onnx config recorded in a model's metadata, if any."""
    data = loaded(model, "config")
    if data is None:
        return None
    try:
        return MhaConfig.from_dict(data)
    except MhaOnnxError:
        raise
    except (TypeError, ValueError) as exc:
        raise damaged("config", exc) from exc


def session_options(model: onnx.ModelProto) -> dict[str, Any]:
    """Session settings the model needs (e.g. {"optimization": "extended"}), recorded by
    fuse when the default crashed ONNX Runtime."""
    return loaded(model, "session") or {}
