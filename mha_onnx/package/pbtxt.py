"""Protobuf text format (Triton's config.pbtxt) of nested dicts and lists, and Triton's
data type names."""

from __future__ import annotations

import json
from typing import Any

TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "float64": "TYPE_FP64",
                "bool": "TYPE_BOOL", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
                "int8": "TYPE_INT8", "uint8": "TYPE_UINT8"}

def to_pbtxt(message: dict[str, Any], indent: int = 0) -> str:
    """Protobuf text format of nested dicts (messages), lists (repeated fields) and scalars;
    a dict under a map field is written as repeated {key, value} entries."""
    pad = "  " * indent
    lines = []
    for key, value in message.items():
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and all(not isinstance(v, dict) for v in value):
            lines.append(f"{pad}{key}: [ {', '.join(_scalar(v, key) for v in value)} ]")
            continue
        for item in items:
            if key == "parameters" and isinstance(item, dict):
                for k, v in item.items():
                    body = to_pbtxt({"value": v}, indent + 1) if isinstance(v, dict) else \
                        f"{'  ' * (indent + 1)}value: {_scalar(v, 'value')}"
                    lines.append(f'{pad}{key} {{\n{"  " * (indent + 1)}key: "{k}"\n{body}\n{pad}}}')
            elif isinstance(item, dict):
                lines.append(f"{pad}{key} {{\n{to_pbtxt(item, indent + 1)}\n{pad}}}")
            else:
                lines.append(f"{pad}{key}: {_scalar(item, key)}")
    return "\n".join(lines)


ENUM_FIELDS = {"data_type", "kind"}


def _scalar(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if key in ENUM_FIELDS:
        return str(value)
    return json.dumps(str(value))
