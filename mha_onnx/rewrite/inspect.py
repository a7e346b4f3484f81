"""A summary of any ONNX model: versions, IO with symbolic dims, ops, attention blocks,
parameters, size and mha-onnx metadata."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from mha_onnx.graph import metadata
from mha_onnx.graph.files import check_structure, external_files, load_external, read_model, to_ir
from mha_onnx.rewrite.blocks import Block, find_blocks
from mha_onnx.rewrite.irutil import all_graphs
from mha_onnx.table import human_bytes, table


@dataclass(frozen=True)
class ValueSummary:
    name: str
    dtype: str
    dims: tuple[str | int | None, ...] | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype,
                "dims": None if self.dims is None else list(self.dims)}

    def render(self) -> str:
        dims = "?" if self.dims is None else ", ".join("?" if d is None else str(d) for d in self.dims)
        return f"{self.name}: {self.dtype}[{dims}]"


@dataclass(frozen=True)
class ModelSummary:
    path: str
    file_bytes: int
    ir_version: int
    opsets: dict[str, int]
    producer: str
    inputs: tuple[ValueSummary, ...]
    outputs: tuple[ValueSummary, ...]
    op_counts: dict[str, int]
    blocks: tuple[Block, ...]
    parameter_count: int
    parameter_bytes: int
    metadata: dict[str, Any]
    understood: dict[str, str] = field(default_factory=dict)  # unfused block -> meaning

    @property
    def fused_blocks(self) -> int:
        return sum(b.kind == "fused" for b in self.blocks)

    @property
    def unfused_blocks(self) -> int:
        return sum(b.kind == "unfused" for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "file_bytes": self.file_bytes,
            "ir_version": self.ir_version,
            "opsets": self.opsets,
            "producer": self.producer,
            "inputs": [v.to_dict() for v in self.inputs],
            "outputs": [v.to_dict() for v in self.outputs],
            "op_counts": self.op_counts,
            "attention_blocks": {
                "fused": self.fused_blocks,
                "unfused": self.unfused_blocks,
                "blocks": [{**b.to_dict(), "understood": self.understood.get(b.node, "")}
                           for b in self.blocks],
            },
            "parameter_count": self.parameter_count,
            "parameter_bytes": self.parameter_bytes,
            "metadata": self.metadata,
        }

    def render(self) -> str:
        opsets = ", ".join(f"{d} {v}" for d, v in sorted(self.opsets.items()))
        lines = [
            f"{self.path}: {human_bytes(self.file_bytes)}, IR {self.ir_version}, opsets {opsets}",
            f"  producer: {self.producer or '?'}",
            "  inputs:",
            *(f"    {v.render()}" for v in self.inputs),
            "  outputs:",
            *(f"    {v.render()}" for v in self.outputs),
            f"  parameters: {self.parameter_count:,} ({human_bytes(self.parameter_bytes)})",
            f"  attention blocks: {self.fused_blocks} fused, {self.unfused_blocks} unfused",
        ]
        if self.blocks:
            lines.append(table(["kind", "op", "node", "graph", "understood as"],
                               [(b.kind, b.op, b.node, b.graph, self.understood.get(b.node, ""))
                                for b in self.blocks], indent="    "))
        top = list(self.op_counts.items())
        lines.append("  ops: " + ", ".join(f"{op} x{n}" for op, n in top))
        fusion = self.metadata.get("fusion")
        if isinstance(fusion, dict) and fusion.get("blocks"):
            lines.append(f"  fused by mha-onnx {fusion.get('version', '?')} (target "
                         f"{fusion.get('target', '?')}, forms for {fusion.get('ep', 'cpu')}):")
            rows = []
            for b in fusion["blocks"]:
                parts = str(b.get("form") or "-").split(" | ")
                rows.append((b.get("block", "?"), b.get("status", "?"), parts[0],
                             b.get("meaning") or b.get("reason") or ""))
                rows += [("", "", f"| {part}", "") for part in parts[1:]]
            lines.append(table(["block", "status", "form", "understood as"], rows, indent="    "))
        if self.metadata:
            lines.append("  mha-onnx metadata:")
            for key, value in self.metadata.items():
                if key in ("params", "fusion"):
                    continue
                lines.append(f"    {key}: {_short_value(value)}")
        return "\n".join(lines)


def _short_value(value: Any) -> str:
    """A metadata value in one readable line: key=value pairs for a dict, long ones cut."""
    if isinstance(value, dict):
        items = [f"{k}={v if not isinstance(v, dict | list) else json.dumps(v, sort_keys=True)}"
                 for k, v in value.items()]
        text = ", ".join(items)
    else:
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."


def _value_summary(value: ir.Value) -> ValueSummary:
    dtype = value.dtype.name.lower() if value.dtype is not None else "?"
    dims = None
    if value.shape is not None:
        dims = tuple(
            d if isinstance(d, int) else (d.value if d.value is not None else None)
            for d in value.shape
        )
    return ValueSummary(value.name or "", dtype, dims)


def summarize(model: onnx.ModelProto, path: str | os.PathLike[str] = "", file_bytes: int = 0) -> ModelSummary:
    graph_ir = to_ir(model, path)
    counts: Counter[str] = Counter()
    for graph in all_graphs(graph_ir.graph):
        for node in graph:
            domain = node.domain if node.domain not in ("", "ai.onnx") else ""
            counts[f"{domain}.{node.op_type}" if domain else node.op_type] += 1
    params = 0
    param_bytes = 0
    for graph in all_graphs(graph_ir.graph):
        for init in graph.initializers.values():
            if init.const_value is None or init.shape is None or not init.dtype.is_floating_point():
                continue
            size = 1
            for dim in init.shape:
                size *= dim if isinstance(dim, int) else 1
            if size > 1:  # scalars are constants, not parameters
                params += size
                param_bytes += init.const_value.nbytes
    return ModelSummary(
        path=str(path),
        file_bytes=file_bytes,
        ir_version=model.ir_version,
        opsets={(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        producer=f"{model.producer_name} {model.producer_version}".strip(),
        inputs=tuple(_value_summary(v) for v in graph_ir.graph.inputs),
        outputs=tuple(_value_summary(v) for v in graph_ir.graph.outputs),
        op_counts=dict(counts.most_common()),
        blocks=tuple(find_blocks(graph_ir.graph)),
        parameter_count=params,
        parameter_bytes=param_bytes,
        metadata=metadata.decoded(model),
        understood=_understood(model, graph_ir),
    )


def _understood(model: onnx.ModelProto, graph_ir: ir.Model) -> dict[str, str]:
    """The meaning fuse would give each unfused block (nothing when all are fused)."""
    if not any(b.kind == "unfused" for b in find_blocks(graph_ir.graph)):
        return {}
    from mha_onnx.rewrite.fuse import understand

    return understand(model)


def inspect_model(path: str | os.PathLike[str]) -> ModelSummary:
    """Read ``path`` (external data included) and summarise it."""
    path = Path(path)
    model = read_model(path, load_external_data=False)
    data_bytes = sum(f.stat().st_size for f in external_files(model, path))
    load_external(model, path)
    check_structure(model, path)
    return summarize(model, path, path.stat().st_size + data_bytes)
