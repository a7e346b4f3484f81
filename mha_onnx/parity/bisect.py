"""``validate --bisect``: where two runs start to disagree.

Two sides run the same inputs: the model on the provider that failed, and either the same
model on another provider (every value of the graph is comparable, inside If branches too)
or the reference model (values with the same name in both graphs are compared: a fused
block's inner values have no counterpart, its boundary values keep their names). The values
of side A's graph are exposed as extra outputs, in topological order, ``chunk`` at a time
(a run holds at most that many intermediate values, so a big graph is searched in pieces),
and the first node with an output beyond tolerance is named with its inputs' errors. When
it is an If of one graph run on two providers, the branch the run took is searched the same
way (its outer values fed from each side's own run). Exposing values can change what a
runtime fuses (Polygraphy's ``--mark all`` has the same caveat): the named node is where
the values of record first differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mha_onnx.graph.walk import attr, subgraphs
from mha_onnx.runtime import make_runner
from mha_onnx.stats import compare

Tolerance = Callable[[str, np.dtype], tuple[float, float]]


@dataclass(frozen=True)
class Side:
    """One run: a model (path) on a provider; ``label`` as the report names it."""

    path: str
    provider: str
    label: str


@dataclass(frozen=True)
class ValueDiff:
    name: str
    max_abs: float | None  # None: not comparable (absent on the other side, shape differs)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.name, "max_abs": self.max_abs, "note": self.note}


@dataclass(frozen=True)
class Divergence:
    node: str
    op_type: str
    output: str
    max_abs: float
    atol: float
    rtol: float
    inputs: tuple[ValueDiff, ...]
    within: tuple[str, ...] = ()  # enclosing If nodes and the branch taken, outermost first

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "output": self.output,
                "max_abs": self.max_abs, "atol": self.atol, "rtol": self.rtol,
                "inputs": [i.to_dict() for i in self.inputs], "within": list(self.within)}


@dataclass(frozen=True)
class BisectReport:
    a: Side
    b: Side
    case: str
    compared: int
    runs: int
    first: Divergence | None
    note: str = ""
    seen: list[str] = field(default_factory=list, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a.label, "b": self.b.label, "case": self.case,
                "values_compared": self.compared, "runs": self.runs,
                "first_divergence": self.first.to_dict() if self.first else None,
                "note": self.note}

    def render(self) -> list[str]:
        head = (f"  bisect ({self.a.label} vs {self.b.label}, {self.case}): {self.compared} "
                f"values compared in {self.runs} run(s)")
        if self.first is None:
            return [head, f"    no intermediate value differs beyond tolerance{self._note()}"]
        f = self.first
        where = "".join(f" in {w}" for w in f.within)
        lines = [head, f"    first divergence: node {f.node!r} ({f.op_type}){where}, output "
                       f"{f.output!r}: max abs {f.max_abs:.3g} > atol {f.atol:g} + rtol {f.rtol:g}"]
        for i in f.inputs:
            err = "not comparable" if i.max_abs is None else f"max abs {i.max_abs:.3g}"
            lines.append(f"      input {i.name!r}: {err}{' (' + i.note + ')' if i.note else ''}")
        if self.note:
            lines.append(f"    note: {self.note}")
        return lines

    def _note(self) -> str:
        return f" ({self.note})" if self.note else ""


def _produced(graph: onnx.GraphProto) -> Iterator[tuple[onnx.NodeProto, str]]:
    for node in graph.node:
        for name in node.output:
            if name:
                yield node, name


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> bytes:
    """The model with ``names`` as extra (untyped) graph outputs; both runtimes type them."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    have = {o.name for o in copy.graph.output}
    for name in names:
        if name not in have:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy.SerializeToString()


def _run(side: Side, model: onnx.ModelProto, names: list[str], feeds: Mapping[str, np.ndarray],
         threads: int | None) -> dict[str, np.ndarray]:
    with make_runner(_with_outputs(model, names), side.provider, threads=threads,
                     strict=False) as runner:
        wanted = {n: feeds[n] for n in runner.input_names if n in feeds}
        return runner.infer(wanted)


def _error(a: np.ndarray | None, b: np.ndarray | None, atol: float, rtol: float
           ) -> tuple[float | None, bool, str]:
    """(max abs, within tolerance, note) of two values of one name."""
    if a is None or b is None:
        return None, True, "absent on one side"
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return None, False, f"shape {a.shape} vs {b.shape}"
    if a.dtype.kind not in "fc" or b.dtype.kind not in "fc":
        same = bool(np.array_equal(a, b))
        return (0.0 if same else float(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64))))
                if a.size else 0.0), same, ""
    stats = compare(a, b, atol=atol, rtol=rtol)
    return stats.max_abs, stats.passed, ""


class _Search:
    """The state of one bisection: both sides' values of record so far."""

    def __init__(self, a: Side, b: Side, feeds_a, feeds_b, tolerance: Tolerance,
                 chunk: int, threads: int | None) -> None:
        self.a, self.b = a, b
        self.feeds_a, self.feeds_b = dict(feeds_a), dict(feeds_b)
        self.tolerance, self.chunk, self.threads = tolerance, max(1, chunk), threads
        self.values_a: dict[str, np.ndarray] = dict(feeds_a)
        self.values_b: dict[str, np.ndarray] = dict(feeds_b)
        self.compared = 0
        self.runs = 0
        self.initializers: set[str] = set()

    def _inputs_of(self, node: onnx.NodeProto) -> tuple[ValueDiff, ...]:
        out = []
        for name in node.input:
            if not name:
                continue
            atol, rtol = self.tolerance(name, np.dtype(np.float32))
            err, _, note = _error(self.values_a.get(name), self.values_b.get(name), atol, rtol)
            if name in self.initializers:
                note = ", ".join(filter(None, ["an initializer", note]))
            out.append(ValueDiff(name, err, note))
        return tuple(out)

    def graph(self, model_a: onnx.ModelProto, model_b: onnx.ModelProto | None,
              within: tuple[str, ...] = ()) -> Divergence | None:
        """Search one (top-level) graph; ``model_b`` None: side B runs ``model_a``."""
        graph = model_a.graph
        self.initializers |= {i.name for i in graph.initializer}
        for init in graph.initializer:
            self.values_a.setdefault(init.name, numpy_helper.to_array(init))
        other = model_b if model_b is not None else model_a
        for init in other.graph.initializer:
            self.values_b.setdefault(init.name, numpy_helper.to_array(init))
        in_b = {name for _, name in _produced(other.graph)}
        order = [(node, name) for node, name in _produced(graph) if name in in_b]
        for start in range(0, len(order), self.chunk):
            part = order[start:start + self.chunk]
            names = [name for _, name in part]
            self.values_a.update(_run(self.a, model_a, names, self.feeds_a, self.threads))
            self.values_b.update(_run(self.b, other, names, self.feeds_b, self.threads))
            self.runs += 2
            for node, name in part:
                self.compared += 1
                got = self.values_a.get(name)
                atol, rtol = self.tolerance(name, got.dtype if got is not None else np.float32)
                err, ok, _ = _error(got, self.values_b.get(name), atol, rtol)
                if ok:
                    continue
                if node.op_type == "If" and model_b is None:
                    inner = self.branch(model_a, node, within)
                    if inner is not None:
                        return inner
                return Divergence(node.name or name, node.op_type, name, err or float("nan"),
                                  atol, rtol, self._inputs_of(node), within)
        return None

    def branch(self, model: onnx.ModelProto, node: onnx.NodeProto, within: tuple[str, ...]
               ) -> Divergence | None:
        """The branch the If took on side A, searched as a model of its own (one graph on two
        providers: each side's outer values feed its own run of the branch)."""
        cond = self.values_a.get(node.input[0])
        if cond is None or cond.size != 1:
            return None
        taken = "then_branch" if bool(cond.reshape(())) else "else_branch"
        body = attr(node, taken)
        outer = _outer_names(body)
        missing = [n for n in outer if n not in self.values_a or n not in self.values_b]
        if missing:
            self.values_a.update(_run(self.a, model, missing, self.feeds_a, self.threads))
            self.values_b.update(_run(self.b, model, missing, self.feeds_b, self.threads))
            self.runs += 2
        sub = _standalone(model, body, {n: self.values_a[n] for n in outer})
        saved = self.feeds_a, self.feeds_b
        self.feeds_a = {n: self.values_a[n] for n in outer}
        self.feeds_b = {n: self.values_b[n] for n in outer}
        try:
            return self.graph(sub, None, (*within, f"If {node.name!r} ({taken.split('_')[0]})"))
        finally:
            self.feeds_a, self.feeds_b = saved


def _outer_names(body: onnx.GraphProto) -> list[str]:
    """Names a branch reads from the enclosing graph (nested subgraphs included)."""
    defined = {i.name for i in body.initializer} | {i.name for i in body.input}
    used: list[str] = []

    def walk(graph: onnx.GraphProto, local: set[str]) -> None:
        local = local | {i.name for i in graph.initializer} | {i.name for i in graph.input}
        for node in graph.node:
            for name in node.input:
                if name and name not in local and name not in used:
                    used.append(name)
            for sub in subgraphs(node):
                walk(sub, local)
            local |= set(node.output)

    walk(body, defined)
    return used


def _standalone(model: onnx.ModelProto, body: onnx.GraphProto,
                outer: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A branch as a model: its outer values become inputs typed from the values seen."""
    graph = onnx.GraphProto()
    graph.CopyFrom(body)
    graph.name = f"{body.name or 'branch'}_standalone"
    del graph.input[:]
    for name, value in outer.items():
        graph.input.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype), list(np.shape(value))))
    out = helper.make_model(graph, opset_imports=list(model.opset_import),
                            ir_version=model.ir_version)
    return out


def after_failure(path: str, config: Any, comparisons: list, runs: list, ran: list[str],
                  cast: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
                  ) -> BisectReport | str:
    """Bisect the first failing comparison of a validate run: side A is the model on the
    provider that failed (not the CPU where another failed too), side B the same model on
    another provider that ran, else the --reference model on ORT's CPU. A string says why
    nothing could be bisected."""
    failing = [c for c in comparisons if not c.stats.passed and not c.case.startswith("decode")]
    if not failing:
        return "no failing comparison outside the decode chains to bisect"
    order = list(dict.fromkeys(c.provider for c in failing))
    provider = next((p for p in order if p != "cpu"), order[0])
    case = next(c.case for c in failing if c.provider == provider)
    feeds = next((f for shape, f in runs if shape.describe() == case), None)
    if feeds is None:
        return f"the inputs of {case!r} are not at hand"
    others = sorted((p for p in ran if p != provider), key=lambda p: p != "cpu")
    a = Side(path, provider, f"{provider}")
    if others:
        b, feeds_b = Side(path, others[0], others[0]), feeds
    elif config.reference:
        b, feeds_b = Side(config.reference, "cpu", "the reference on cpu"), cast(feeds)
    else:
        return ("bisect needs a second run of an ONNX graph: --reference ORIGINAL or a second "
                "provider (the PyTorch reference exposes no intermediate values)")
    return bisect(a, b, feeds, feeds_b, case,
                  lambda name, dtype: config.tolerance_for(name, dtype, provider),
                  chunk=config.bisect_chunk, threads=config.threads)


def bisect(a: Side, b: Side, feeds_a: Mapping[str, np.ndarray],
           feeds_b: Mapping[str, np.ndarray], case: str, tolerance: Tolerance, *,
           chunk: int = 256, threads: int | None = None) -> BisectReport:
    """The first node of ``a``'s graph whose output differs from ``b``'s beyond tolerance."""
    from mha_onnx.graph.files import read_model

    model_a = read_model(a.path)
    model_b = None if b.path == a.path else read_model(b.path)
    search = _Search(a, b, feeds_a, feeds_b, tolerance, chunk, threads)
    first = search.graph(model_a, model_b)
    note = ""
    if model_b is not None:
        note = ("values compared where both graphs have them (a fused block's inner values "
                "have no counterpart in its original)")
    if first is None:
        note = "; ".join(filter(None, [note, (
            "with every value exposed the two runs agree: the runtime computes differently "
            "when it cannot fuse across them (look at its own fusions)" if model_b is None else
            "the difference is inside a fused block (bisect it on two providers)")]))
    return BisectReport(a, b, case, search.compared, search.runs, first, note)
