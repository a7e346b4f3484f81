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

PREFIX = "mha_onnx."
JSON_KEYS = ("config", "params", "fusion", "session")


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


def config_of(model: onnx.ModelProto) -> MhaConfig | None:
    """The mha-onnx config recorded in a model's metadata, if any."""
    text = read(model).get("config")
    return None if text is None else MhaConfig.from_dict(json.loads(text))


def session_options(model: onnx.ModelProto) -> dict[str, Any]:
    """Session settings the model needs (e.g. {"optimization": "extended"}), recorded by
    fuse when the default crashed ONNX Runtime."""
    text = read(model).get("session")
    return {} if text is None else dict(json.loads(text))
