"""``validate --ranges``: how close a model's activations come to float16's range.

A float16 model whose activations pass 65504 gives inf, then NaN, with no error (gpt-oss's
float16 activations, onnxruntime-genai#2444); PyTorch in float16 overflows alike, so a
comparison with it can pass NaN against NaN. Every value the main graph computes is exposed
as an output, ``chunk`` at a time (bisect.py's way), on the run's inputs: each float value's
largest finite magnitude, the values within ``NEAR`` of float16's largest, and the first node
that makes a non-finite value out of finite inputs (an overflow: a mask's -inf fill is not
one, it comes in non-finite; nor is a log of 0, DOMAIN_EDGES). A float32 model gets the
same table: where its values would overflow if it were exported in float16.

ORT's CPU provider runs many float16 operators in float32 (casts it inserts, and removes
where two meet), so a float16 model can give finite outputs on the CPU where a GPU's float16
kernels give inf: a value exposed here is cast back to float16, as a GPU keeps it. What
``export --keep-float32`` keeps wide (float32 values of a float16 model) is not counted near
the range.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx

from mha_onnx.parity.bisect import _produced, _with_outputs
from mha_onnx.parity.report import ValidationReport
from mha_onnx.runtime import make_runner

FP16_MAX = 65504.0
NEAR = 0.25  # a value past a quarter of float16's range is an Add or a square from inf
SHOWN = 5
# Operators whose finite inputs give finite outputs of modest size in any float type (log of
# float16's largest is 11): an inf or NaN from them is their domain's edge (log 0, sqrt of a
# negative), the same in float32, never an overflow. T5's relative position buckets take
# the log of 0 on purpose and a Where drops it.
DOMAIN_EDGES = frozenset({"Log", "Sqrt", "Acos", "Asin", "Acosh", "Atanh"})


@dataclass(frozen=True)
class Peak:
    node: str
    op: str
    value: str
    peak: float  # the largest finite magnitude over the runs
    finite: bool  # no inf or NaN in any run
    weight: str = ""  # (an overflow) the constant holding inf/NaN it reads, if that is why
    module: str = ""  # the PyTorch module it came from, where torch.export recorded it
    bits: int = 32  # its float type's width

    def under(self, scope: str) -> Peak:
        """This peak with its module named below ``scope`` (the exported part's module in
        the whole model, where torch.export recorded names relative to the part), in its
        node's label too."""
        if not (scope and self.module):
            return self
        name = self.node.removesuffix(f" [{self.module}]")
        whole = f"{scope}.{self.module}"
        return replace(self, module=whole, node=_labelled(name, whole))

    def said(self) -> str:
        if self.weight:
            return (f"{self.node} ({self.op}) reads {self.weight}, a constant holding inf/NaN "
                    "(its values do not fit float16's range) and gives inf/NaN")
        keep = (f"export --dtype float16 --keep-float32 {self.module} keeps that module in "
                "float32" if self.module else "keep that layer in float32 or scale it")
        return (f"{self.node} ({self.op}) makes inf/NaN from finite inputs (its output "
                f"{self.value}); {keep}")


@dataclass(frozen=True)
class Ranges:
    peaks: tuple[Peak, ...]  # every float value of the main graph, largest first
    overflow: Peak | None  # the first node giving non-finite values from finite inputs
    runs: int
    half: bool = False  # the model computes in float16 (some of its values are)

    @property
    def near(self) -> list[Peak]:
        """Values near float16's largest: of a float16 model, its float16 ones (what it
        keeps in float32 may pass it); of a float32 model, every one."""
        return [p for p in self.peaks if p.peak >= NEAR * FP16_MAX
                and not (self.half and p.bits == 32)]

    @property
    def passed(self) -> bool:
        return self.overflow is None

    def to_dict(self) -> dict:
        row = lambda p: {"node": p.node, "op": p.op, "value": p.value,  # noqa: E731
                         "peak": p.peak, "finite": p.finite, "weight": p.weight,
                         "module": p.module, "bits": p.bits}
        return {"runs": self.runs, "overflow": row(self.overflow) if self.overflow else None,
                "near_float16_max": [row(p) for p in self.near],
                "largest": [row(p) for p in self.peaks[:SHOWN]]}

    def render(self) -> list[str]:
        top = ", ".join(f"{p.node} ({p.op}) {p.peak:.4g}" for p in self.peaks[:SHOWN])
        lines = [f"  ranges over {self.runs} run(s): largest activations {top}"]
        if self.near:
            lines.append(f"  ranges: {len(self.near)} value(s) past {NEAR:g} x float16's "
                         f"largest ({FP16_MAX:g}): " + ", ".join(
                             f"{p.node} ({p.op}) {p.peak:.4g}" for p in self.near[:SHOWN]))
        if self.overflow is not None:
            lines.append(f"  FAIL ranges: {self.overflow.said()}")
        return lines


def activation_ranges(path: str, model: onnx.ModelProto,
                      runs: Sequence[Mapping[str, np.ndarray]], *, chunk: int = 256,
                      threads: int | None = None) -> Ranges:
    """The ranges of ``model`` (at ``path``, for its external data) over ``runs``."""
    produced = [(node, name) for node, name in _produced(model.graph)]
    peaks: dict[str, float] = {}
    bits: dict[str, int] = {}
    bad: set[str] = set()
    hard: set[str] = set()  # NaN or +inf: never a mask's fill (-inf, or finite sums to -inf)
    for start in range(0, len(produced), chunk):
        names = [name for _, name in produced[start:start + chunk]]
        with make_runner(_with_outputs(model, names), "cpu", threads=threads,
                         strict=False, external_data_dir=_folder(path)) as runner:
            for feeds in runs:
                got = runner.infer({n: feeds[n] for n in runner.input_names if n in feeds})
                for name in names:
                    _record(name, got.get(name), peaks, bad, hard)
                    if name in peaks:
                        bits[name] = got[name].dtype.itemsize * 8
    fills, constants = _non_finite_constants(model)
    unfinished = bad | fills | constants  # (inputs are finite: made so)
    found = []
    for node, name in produced:
        if name not in bad or _constant_fill(node) or node.op_type in DOMAIN_EDGES:
            continue
        read = [i for i in node.input if i in constants]
        if read or not any(i in unfinished for i in node.input if i):
            found.append((name not in hard, Peak(_label(node), node.op_type, name,
                                                 peaks.get(name, 0.0), False,
                                                 read[0] if read else "", _module(node),
                                                 bits.get(name, 32))))
    # the first giving NaN or +inf; only -inf (two mask fills added) where none does
    overflow = min(found, key=lambda f: f[0])[1] if found else None
    ranked = sorted((Peak(n.name or n.op_type, n.op_type, name, peaks[name], name not in bad,
                          module=_module(n), bits=bits[name])
                     for n, name in produced if name in peaks),
                    key=lambda p: p.peak, reverse=True)
    return Ranges(tuple(ranked), overflow, len(runs), any(b == 16 for b in bits.values()))


NO_REFERENCE = ("no reference (no export metadata to rebuild PyTorch's from, no --reference): "
                "the activation ranges only")


def ranges_alone(path: str, config: Any, ranges: Ranges, started: float) -> ValidationReport:
    """validate's report of --ranges on a file with nothing to compare it with (no export
    metadata, no --reference): its ``ranges``, said to be all it holds."""
    return ValidationReport(model=str(path), references=(), providers=(), comparisons=(),
                            masked_rows=(), checks=(), allow_missing=config.allow_missing,
                            seconds=time.perf_counter() - started, notes=(NO_REFERENCE,),
                            ranges=ranges)


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _record(name: str, array: np.ndarray | None, peaks: dict[str, float], bad: set[str],
            hard: set[str]) -> None:
    if array is None or array.dtype.kind != "f" or array.size == 0:
        return
    finite = np.isfinite(array)
    if not finite.all():
        bad.add(name)
        if np.isnan(array).any() or np.isposinf(array).any():
            hard.add(name)
    values = np.abs(array[finite]) if not finite.all() else np.abs(array)
    peak = float(values.max()) if values.size else 0.0
    peaks[name] = max(peaks.get(name, 0.0), peak)


def _label(node: onnx.NodeProto) -> str:
    """The node's name, with the module it came from where torch.export recorded it
    (``node_linear_13 [model.layers.1.mlp.down_proj]``)."""
    return _labelled(node.name or node.op_type, _module(node))


def _labelled(name: str, module: str) -> str:
    return f"{name} [{module}]" if module else name


def _module(node: onnx.NodeProto) -> str:
    """The PyTorch module a node came from, where torch.export recorded it; "" else."""
    import ast

    scopes = next((p.value for p in node.metadata_props
                   if p.key == "pkg.torch.onnx.name_scopes"), None)
    try:
        module = ast.literal_eval(scopes)[-2] if scopes else ""
    except (ValueError, SyntaxError, IndexError):
        module = ""
    return module.removeprefix("inner.")


def _constant_fill(node: onnx.NodeProto) -> bool:
    """A node that writes a constant it holds (Constant, ConstantOfShape): an -inf there is
    a mask's fill, not an overflow."""
    return node.op_type in ("Constant", "ConstantOfShape")


def _non_finite_constants(model: onnx.ModelProto) -> tuple[set[str], set[str]]:
    """Float initializers holding inf or NaN: (fills: every value non-finite, a mask's -inf;
    broken: finite values among them, a weight whose largest did not fit the float type);
    external ones unread."""
    fills, broken = set(), set()
    for t in model.graph.initializer:
        if t.data_type not in _FLOATS or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        finite = np.isfinite(onnx.numpy_helper.to_array(t))
        if not finite.all():
            (broken if finite.any() else fills).add(t.name)
    return fills, broken


def _folder(path: str) -> str | None:
    from pathlib import Path

    return str(Path(path).resolve().parent) if path else None
