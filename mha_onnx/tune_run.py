"""The tuning run: candidates fused and verified, timed on this machine, the dispatching model
verified over every interval and written (see :mod:`mha_onnx.tune`)."""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from mha_onnx import metadata
from mha_onnx.config import FORM_CHOICES
from mha_onnx.errors import ConfigError, InputSpecError
from mha_onnx.graphio import prepare_output, read_model, write_model
from mha_onnx.inputs import case_for, input_specs, split_dims
from mha_onnx.tune import (
    DEFAULT,
    ORIGINAL,
    TUNING,
    Rule,
    TuneConfig,
    TuneResult,
    choose,
    choose_by_batch,
    first_rule,
    settle,
)
from mha_onnx.tune_dispatch import dispatch

# A point is skipped when its attention scores alone would pass this many elements (batch *
# heads * length^2): the default grid's batch 32 x 1024 of the base export (8 heads, 2^28)
# took 55 s on a 2-core machine, 38 s of it the first runs of four candidates faulting in
# their memory: alone past the 60 s a tune may take. Its rules are those of the lengths
# below it. A point of 2^24 or more is timed on 3 interleaved runs after the warm-up, not 5
# (a run there takes 0.1 s or more on such a machine).
MAX_SCORES = 2 ** 27
QUICK_SCORES = 2 ** 24


def candidates(original: onnx.ModelProto
               ) -> tuple[dict[str, onnx.ModelProto], list[str], list]:
    """{name: model}: the original, the default fusion and one fusion per other form of
    each mask kind the model's blocks have, each verified against the original (a form
    that fails verification is left out, said in the notes)."""
    from mha_onnx.rewrite import fuse_model
    from mha_onnx.rewrite.lower.ort import Forms
    from mha_onnx.rewrite.verify import verification_cases, verify

    fused, results, _ = fuse_model(original)
    kinds = sorted({r.mask for r in results if r.status == "fused"} & set(FORM_CHOICES))
    out, notes = {ORIGINAL: original, "fused": fused}, []
    default = Forms()
    for kind in kinds:
        for form in FORM_CHOICES[kind]:
            if kind == "kv_cache" or form == getattr(default, kind):
                continue
            model, res, _ = fuse_model(original, forms=Forms.parse([f"{kind}={form}"]))
            out[f"{kind}={form}"] = model
    for name in [n for n in out if n != ORIGINAL]:
        check = verify(original, out[name], cases=verification_cases(original, results))
        if not check.passed:
            notes.append(f"candidate {name} left out: {check.first_failure()}")
            del out[name]
    return out, notes, results


def _dims(model: onnx.ModelProto) -> tuple[str, str]:
    """(the length dim to dispatch on, the batch dim), "" where the model has none dynamic
    (a ViT's images have no length: it is tuned over the batch alone)."""
    specs = input_specs(model)
    if any(len(s.dims) == 4 and s.name.startswith("past") for s in specs):
        raise InputSpecError("--tune: KV-cache models are not tuned yet",
                             hint="fuse it without --tune: a fused KV-cache model runs as it is")
    batches, lengths = split_dims(specs)
    if not lengths and not batches:
        raise InputSpecError("--tune needs a model with a dynamic batch or length to "
                             "dispatch on")
    return (lengths[-1] if lengths else ""), (batches[0] if batches else "")


def _time(paths: dict[str, str], cfg: TuneConfig, heads: int,
          progress: Callable[[str], None], points: list[tuple[int, int]] | None = None):
    """(p50 ms, median paired ratio to the original) per (batch, length) per candidate,
    interleaved, the whole grid in one child process, largest point first (see
    ``measure_grid``: a session faults in its memory once); ``points``: these (batch,
    length) only, else the grid."""
    import numpy as np

    from mha_onnx.profile.worker import PointSpec, grid_in_child

    order = list(paths)
    grid = []
    for batch, length in points or [(b, n) for b in cfg.batches for n in cfg.seq_lens]:
        if batch * heads * length * length > MAX_SCORES:
            progress(f"batch {batch} x {length}: skipped (too large to time in the budget: "
                     "the rules of the shorter lengths apply)")
        else:
            grid.append((batch, length))
    grid.sort(key=lambda p: -p[0] * p[1] * p[1])
    specs = [PointSpec(models=tuple(paths[n] for n in order), batch=batch, seq_len=length,
                       threads=cfg.threads, warmup=2,
                       iters=3 if batch * heads * length * length >= QUICK_SCORES else 5,
                       min_time=cfg.min_time, pad_fraction=cfg.pad_fraction)
                 for batch, length in grid]
    table: dict[tuple[int, int], dict[str, float]] = {}
    ratios: dict[tuple[int, int], dict[str, float]] = {}

    done: list[int] = []

    def point_done(index: int, raw: dict) -> None:
        batch, length = grid[index]
        done.append(index)
        where = f"{len(done)}/{len(grid)} batch {batch}" + (f" x {length}" if length else "")
        mine = raw.get("models", {})
        if "error" in raw or "times" not in mine.get(paths[ORIGINAL], {}):
            why = raw.get("error") or mine.get(paths[ORIGINAL], {}).get("error", "?")
            progress(f"{where}: skipped, the original does not run there ({why[:160]})")
            return
        runs = {n: np.array(mine[paths[n]]["times"]) for n in order
                if "times" in mine.get(paths[n], {})}
        times = {n: float(np.median(t)) * 1e3 for n, t in runs.items()}
        table[(batch, length)] = times
        # the runs interleave, one of each candidate in turn: the median of the paired
        # ratios to the original is what the choice reads (steadier than a ratio of
        # medians on a shared machine)
        ratios[(batch, length)] = {n: float(np.median(t[:len(runs[ORIGINAL])] /
                                                      runs[ORIGINAL][:len(t)]))
                                   for n, t in runs.items()}
        best = min(times, key=times.get)
        progress(f"{where}: {best} {times[best]:.3g} ms (original {times[ORIGINAL]:.3g} ms)")

    grid_in_child(specs, point_done)
    return ({p: table[p] for p in sorted(table)}, {p: ratios[p] for p in sorted(ratios)})


def _confirmed(paths: dict[str, str], cfg: TuneConfig, heads: int, ratios,
               batch_dim: str, progress: Callable[[str], None]) -> list[Rule]:
    """The rules, chosen again after the points where they depart from the default fusion
    were timed once more (each candidate's ratio there: the geometric mean of both runs;
    ``ratios`` updated). A burst of other work on a shared machine made one timing read the
    fusion 1.09x and 1.14x of the original at two points where a second run read 0.95x and
    0.90x: a departure from the default is taken on two runs, not one."""
    def rules_for(table) -> list[Rule]:
        return choose_by_batch(table) if batch_dim else choose(table)

    rules = rules_for(ratios)
    disputed = [p for p in sorted(ratios)
                if rules[first_rule(rules, p)].name != DEFAULT]
    if not disputed:
        return rules
    progress(f"timing again where the choice is not the default fusion: {len(disputed)} "
             "point(s)")
    _, again = _time(paths, cfg, heads, progress, disputed)
    for point, second in again.items():
        first = ratios[point]
        ratios[point] = {n: math.sqrt(first[n] * second[n]) for n in first if n in second}
    return rules_for(ratios)


def _settle(tuned: onnx.ModelProto, paths: dict[str, str], rules: list[Rule], ratios,
            cfg: TuneConfig, heads: int, progress: Callable[[str], None]
            ) -> tuple[list[Rule], str, dict[tuple[int, int], float]]:
    """``rules``, or one candidate alone where ``tuned`` (their dispatching model) loses at
    the grid's shortest length because of its own If (timed there against the original:
    ``tune.settle``), and its ratios to the original there."""
    if len(rules) == 1:
        return rules, "", {}
    path = str(Path(paths[ORIGINAL]).with_name("dispatch.onnx"))
    onnx.save(tuned, path)
    shortest = min(n for _, n in ratios)
    progress("timing the dispatching model itself" + (f" at length {shortest}" if shortest
                                                       else ""))
    probe_cfg = replace(cfg, seq_lens=(shortest,))
    _, probe = _time({ORIGINAL: paths[ORIGINAL], "dispatch": path}, probe_cfg,
                     heads, progress)
    mine = {p: r["dispatch"] for p, r in probe.items() if "dispatch" in r}
    return (*settle(ratios, rules, mine), mine)


def tune_model(source: str | Path, output: str | Path, cfg: TuneConfig, *, force: bool = False,
               progress: Callable[[str], None] = lambda _: None) -> TuneReport:
    """Fuse every candidate, time them here, write the dispatching model (verified)."""
    from mha_onnx.profile.roofline import machine_info
    from mha_onnx.rewrite.verify import verify

    started = time.perf_counter()
    output = prepare_output(output, force=force)
    original = _the_original(source, progress)
    dim, batch_dim = _dims(original)
    if not dim:  # (one point a batch: the model's own sizes; 0 stands for no length)
        cfg = replace(cfg, seq_lens=(0,))
    progress("fusing and verifying the candidates")
    models, notes, results = candidates(original)
    if len(models) == 1:
        raise ConfigError("--tune: no attention block was fused, nothing to choose")
    heads = max([int(r.details.get("heads", 1)) for r in results] + [1])
    with tempfile.TemporaryDirectory(prefix="mha_onnx_tune_") as tmp:
        paths = {}
        for n, (name, model) in enumerate(models.items()):
            paths[name] = str(Path(tmp) / f"c{n}.onnx")
            onnx.save(model, paths[name])
        table, ratios = _time(paths, cfg, heads, progress)
        if not table:
            raise ConfigError("--tune: every point of the grid was skipped",
                              hint="smaller --tune-batch / --tune-seq-lens")
        chosen = _confirmed(paths, cfg, heads, ratios, batch_dim, progress)
        rules, why, probe = _settle(dispatch(models, chosen, dim, batch_dim), paths, chosen,
                                    ratios, cfg, heads, progress)
    if why:  # one candidate alone instead
        notes.append(why)
    result = TuneResult(rules, {f"{b}x{n}": t for (b, n), t in table.items()}, dim,
                        {**machine_info(), "threads": cfg.threads},
                        {f"{b}x{n}": round(r, 4) for (b, n), r in probe.items()}, batch_dim)
    tuned = assemble(original, models, result, results)
    check = verify(original, tuned, cases=_branch_cases(original, rules, table, dim))
    if not check.passed:
        raise ConfigError(f"the tuned model differs from the original: {check.first_failure()}",
                          hint="nothing was written; please report this model")
    notes += _size_note(original, tuned)
    write_model(tuned, output, force=force)
    return TuneReport(str(output), result, tuple(notes), time.perf_counter() - started)


def assemble(original: onnx.ModelProto, models: dict[str, onnx.ModelProto],
             result: TuneResult, results: list) -> onnx.ModelProto:
    """The dispatching model of ``result``'s rules over ``models``, with the original's
    metadata, the fusion's (each fused block labelled with the rules), the tuning table,
    where the PyTorch reference finds each weight, and the original kept (so that ``tune``
    can tune it again elsewhere: mha_onnx.original)."""
    from mha_onnx.original import record
    from mha_onnx.rewrite.fuse import carry_metadata

    stored: dict[str, dict[str, str]] = {}
    tuned = dispatch(models, result.rules, result.dim, result.batch_dim, stored)
    labelled = [replace(r, form=f"tuned: {result.describe()}") if r.status == "fused" else r
                for r in results]
    carry_metadata(original, tuned, labelled, "ort", "cpu")  # the original's, and the fusion
    packed = _packed_at(models, stored)
    metadata.write(tuned, {TUNING: result.to_dict(), **_weights_at(original, stored),
                           **({"packed": packed} if packed else {})})
    record(original, tuned)
    return tuned


def _packed_at(models: dict[str, onnx.ModelProto], stored: dict[str, dict[str, str]]
               ) -> dict[str, list]:
    """Each weight a candidate's fusion packed: [joined, start, end], the joined tensor by
    its name in the tuned model (the first candidate holding it: the shallowest copy)."""
    out: dict[str, list] = {}
    for candidate, names in stored.items():
        for name, (joined, start, end) in (metadata.loaded(models[candidate], "packed")
                                           or {}).items():
            if joined in names:
                out.setdefault(name, [names[joined], start, end])
    return out


def _weights_at(original: onnx.ModelProto, stored: dict[str, dict[str, str]]) -> dict:
    """The original's "params" (where the PyTorch reference finds each weight) pointed at
    the tuned model's copies (a weight may lie only in a branch, under its prefix; a packed
    one is found by the tuned model's "packed"). The first candidate holding it wins
    (``stored`` is in rule order: the shallowest copy). {} where the original records no
    params."""
    params = metadata.loaded(original, "params")
    if not params:
        return {}
    out = {}
    for name, where in params.items():
        initializer = where.get("initializer") if isinstance(where, dict) else None
        at = next((names[initializer] for names in stored.values() if initializer in names),
                  None)
        out[name] = where if at is None else {**where, "initializer": at}
    return {"params": out}


def _the_original(source: str | Path, progress: Callable[[str], None]) -> onnx.ModelProto:
    """``source``, or the original a fused or tuned ``source`` keeps (tuned again from it:
    the forms are chosen among fusions of the original)."""
    from mha_onnx.original import restore

    model = read_model(source)
    done = [k for k in ("tuning", "fusion") if k in metadata.read(model)]
    if not done:
        return model
    original = restore(model)
    if original is None:
        raise ConfigError(f"{source} is already {'tuned' if 'tuning' in done else 'fused'} and "
                          "does not keep its original (fused by an older mha-onnx, with "
                          "external data, or with over 256 MB of weights fuse rewrote)",
                          hint="tune the original (unfused) model")
    ep = (metadata.loaded(model, "fusion") or {}).get("ep", "cpu")
    progress(f"{source} is {'tuned' if 'tuning' in done else 'fused'}: tuning again from "
             "the original it keeps" + ("" if ep == "cpu" else f" (its forms were for {ep}; "
                                        "the tuner times forms on the CPU)"))
    return original


def _size_note(original: onnx.ModelProto, tuned: onnx.ModelProto) -> list[str]:
    """A note where the tuned model is much bigger than the original (the weights of the
    candidates past the second are held again by the else graph above them:
    tune_dispatch)."""
    grown = tuned.ByteSize() / max(original.ByteSize(), 1)
    if grown < 1.5:
        return []
    return [f"the tuned model is {grown:.1f}x the original's size: past the first two "
            "candidates, each If's else graph holds a copy of the weights of the candidates "
            "inside it (ONNX Runtime prepacks a MatMul's weight only from one graph up, and "
            "ran such a candidate up to 1.3x slower with its weights shared); a smaller grid "
            "gives fewer candidates"]


def _branch_cases(original: onnx.ModelProto, rules: list[Rule], table, dim: str) -> list:
    """Verification cases reaching every branch ``rules`` can select: each grid length up to
    1024 at batch 2, and for each rule the cheapest point (batch x length^2) where it is the
    first that applies, among the batches 1, 2 and either side of each batch bound and the
    grid lengths and either side of each length bound."""
    specs = input_specs(original)
    lengths = {n for _, n in table if n <= 1024}
    points = {(2, n) for n in lengths}
    batches = {1, 2} | {b for r in rules if r.batch_below for b in (r.batch_below - 1,
                                                                     r.batch_below)}
    lengths |= {n for r in rules if r.below for n in (r.below - 1, r.below) if n >= 1}

    for i in range(len(rules)):
        reach = [(b, n) for b in batches for n in lengths
                 if b >= 1 and first_rule(rules, (b, n)) == i]
        if reach:
            points.add(min(reach, key=lambda p: (p[0] * p[1] ** 2, p)))
    return [case_for(specs, f"tuned, batch {b}, {dim} {n}", b, [n], "some")
            for b, n in sorted(points)]


@dataclass(frozen=True)
class TuneReport:
    output: str
    result: TuneResult
    notes: tuple[str, ...]
    seconds: float

    def to_dict(self) -> dict:
        return {"output": self.output, "rules": self.result.describe(),
                "tuning": self.result.to_dict(), "notes": list(self.notes),
                "seconds": round(self.seconds, 1)}

    def render(self) -> str:
        lines = [f"tuned {self.output} on this machine ({self.seconds:.0f} s)",
                 f"  runs: {self.result.describe()}"]
        for key, times in self.result.table.items():
            best = min(times, key=times.get)
            lines.append(f"  {'batch' if key.endswith('x0') else 'batch x length'} "
                         f"{key.removesuffix('x0')}: {best} {times[best]:.3g} ms, original "
                         f"{times[ORIGINAL]:.3g} ms ({times[best] / times[ORIGINAL]:.2f}x)")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  wrote {self.output}")
        return "\n".join(lines)
