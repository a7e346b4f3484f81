"""Timing the candidates on this machine for the tuner (see :mod:`mha_onnx.tune.rules`):
the grid in two passes within the budget (tune.plan), the departures from the default fusion timed
again, the dispatching model's own cost at the shortest length."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import onnx

from mha_onnx.tune.plan import (
    AGAIN,
    fit_budget,
    margin_of,
    noise,
    split_grid,
    survivors,
    without_twin,
)
from mha_onnx.tune.rules import (
    DEFAULT,
    MARGIN,
    ORIGINAL,
    Rule,
    TuneConfig,
    choose,
    choose_by_batch,
    first_rule,
    settle,
)

# A point is skipped when its attention scores alone would pass this many elements (batch *
# heads * length^2): the default grid's batch 32 x 1024 of the base export (8 heads, 2^28)
# took 55 s on a 2-core machine, 38 s of it the first runs of four candidates faulting in
# their memory: alone past the 60 s a tune may take. Its rules are those of the lengths
# below it. A point of 2^24 or more is timed on 3 interleaved runs after the warm-up, not 5
# (a run there takes 0.1 s or more on such a machine).
MAX_SCORES = 2 ** 27
QUICK_SCORES = 2 ** 24


def _scores(batch: int, length: int, heads: int) -> int:
    """The attention scores one run at (batch, length) holds: batch * heads * length^2."""
    return batch * heads * length * length


def time_grid(paths: dict[str, str], cfg: TuneConfig, heads: int,
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
        if _scores(batch, length, heads) > MAX_SCORES:
            progress(f"batch {batch} x {length}: skipped (too large to time in the budget: "
                     "the rules of the shorter lengths apply)")
        else:
            grid.append((batch, length))
    grid.sort(key=lambda p: -p[0] * p[1] * p[1])
    specs = [PointSpec(models=tuple(paths[n] for n in order), batch=batch, seq_len=length,
                       threads=cfg.threads, warmup=2,
                       iters=3 if _scores(batch, length, heads) >= QUICK_SCORES else 5,
                       min_time=cfg.min_time, pad_fraction=cfg.pad_fraction)
                 for batch, length in grid]
    table: dict[tuple[int, int], dict[str, float]] = {}
    ratios: dict[tuple[int, int], dict[str, float]] = {}

    done: list[int] = []
    began = time.perf_counter()

    def point_done(index: int, raw: dict) -> None:
        batch, length = grid[index]
        done.append(index)
        spent = time.perf_counter() - began
        left = spent / len(done) * (len(grid) - len(done))  # (points of one pass, largest
        eta = f", about {left:.0f} s left" if len(done) < len(grid) else ""  # first)
        where = f"{len(done)}/{len(grid)}{eta}: batch {batch}" + (f" x {length}" if length
                                                                  else "")
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


def confirmed(paths: dict[str, str], cfg: TuneConfig, heads: int, ratios, batch_dim: str,
              progress: Callable[[str], None], margin: float = MARGIN) -> list[Rule]:
    """The rules (a candidate replaces the default fusion where it is more than ``margin``
    faster: the original is one), chosen again after the points where they depart from the
    default fusion were timed once more with the original, the default fusion and the
    candidate chosen there (each ratio there: the geometric mean of both runs; ``ratios``
    updated). A burst of other work on a shared machine made one timing read the fusion
    1.09x and 1.14x of the original at two points where a second run read 0.95x and 0.90x:
    a departure from the default is taken on two runs, not one."""
    def rules_for(table) -> list[Rule]:
        return (choose_by_batch if batch_dim else choose)(table, DEFAULT, margin)

    rules = rules_for(ratios)
    chosen = {p: rules[first_rule(rules, p)].name for p in sorted(ratios)}
    disputed = [p for p, name in chosen.items() if name != DEFAULT]
    if not disputed:
        return rules
    progress(f"timing again where the choice is not the default fusion: {len(disputed)} "
             "point(s)")
    named = {ORIGINAL, DEFAULT} | {chosen[p] for p in disputed}
    _, again = time_grid({n: v for n, v in paths.items() if n in named}, cfg, heads,
                         progress, disputed)
    for point, second in again.items():
        first = ratios[point]
        ratios[point] = {n: math.sqrt(first[n] * second[n]) for n in first if n in second}
    return rules_for(ratios)


def settled(tuned: onnx.ModelProto, paths: dict[str, str], rules: list[Rule], ratios,
            cfg: TuneConfig, heads: int, progress: Callable[[str], None],
            margin: float = MARGIN) -> tuple[list[Rule], str, dict[tuple[int, int], float]]:
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
    _, probe = time_grid({ORIGINAL: paths[ORIGINAL], "dispatch": path}, probe_cfg, heads,
                         progress)
    mine = {p: r["dispatch"] for p, r in probe.items() if "dispatch" in r}
    return (*settle(ratios, rules, mine, margin=margin), mine)



def two_passes(paths: dict[str, str], cfg: TuneConfig, heads: int, started: float,
               progress: Callable[[str], None]):
    """The grid's shortest length of each batch with every candidate, then the rest with
    the candidates that were near the best (tune.plan), as far as the budget lets: (table,
    ratios, notes)."""
    points = [(b, n) for b in cfg.batches for n in cfg.seq_lens]
    first, rest = split_grid(points)
    table, ratios = time_grid(paths, cfg, heads, progress, first)
    keep = survivors(without_twin(ratios), margin_of(noise(ratios)))
    left = (cfg.budget - (time.perf_counter() - started)) * 0.7  # (the rest: departures
    # timed again, the dispatch timed itself, the verification)
    todo, dropped = fit_budget([p for p in rest if _scores(*p, heads) <= MAX_SCORES],
                               table, len(keep), 8, left)
    notes = []
    if dropped:
        notes.append(f"--tune-budget {cfg.budget:g} s: {len(dropped)} point(s) not timed "
                     f"(the largest: {', '.join(f'{b}x{n}' for b, n in dropped[-3:])}); the "
                     "rules of the shorter lengths apply there")
    if len(keep) < len(paths):
        progress(f"second pass with {len(keep) - 1} candidate(s) (the others lost everywhere "
                 f"on the first): {', '.join(sorted(n for n in keep if n != AGAIN))}")
    if todo:
        more, again = time_grid({n: v for n, v in paths.items() if n in keep}, cfg, heads,
                                progress, todo)
        table.update(more)
        ratios.update(again)
    return ({p: table[p] for p in sorted(table)}, {p: ratios[p] for p in sorted(ratios)},
            notes)
