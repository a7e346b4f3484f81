"""``fuse --tune`` and ``mha-onnx tune``: forms chosen on the machine that runs them.

The candidates are the original graph and the model fused with each kernel form of its mask
kind (``FormPolicy.candidates``). Each candidate is timed on this machine over a grid of
batch x length, interleaved in one process with sleeping thread pools (the profile
machinery), and for each batch and length the candidate whose ratio to the original is
lowest wins (the original is a candidate: where it wins, it runs). Lengths with the same winner form intervals, batches
with the same intervals form groups; the boundaries lie at the geometric mean of the grid
values on either side. The tuned model dispatches at run time on the batch and length: the
rules are a table in the graph, the first that applies names the candidate, and each
candidate is one If branch (:mod:`mha_onnx.tune.dispatch`). That dispatch costs a
constant time of its own, which the candidates' timings do not hold: the dispatching model
is timed itself at the grid's shortest length, and where it loses there, one candidate
alone is written instead if it stays within MARGIN of the original everywhere and gives up
nothing the dispatch gains elsewhere (``settle``). The tuning table (machine, cores, ORT
version, threads, times) is in the metadata, so ``mha-onnx tune`` can time the same
branches again on another machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ORIGINAL = "original"
TUNING = "tuning"


@dataclass(frozen=True)
class TuneConfig:
    """``max_size``: the tuned model's weights at most this many times the original's
    (tune.plan); ``budget``: seconds the timing may take (points past it dropped)."""

    batches: tuple[int, ...] = (1, 8, 32)
    seq_lens: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    threads: int | None = None
    min_time: float = 0.15
    pad_fraction: float = 0.25
    max_size: float = 1.1
    budget: float = 150.0

    def __post_init__(self) -> None:
        from mha_onnx.errors import ConfigError

        if self.max_size < 1 or self.budget <= 0:
            raise ConfigError("--tune-max-size must be >= 1 and --tune-budget > 0")


@dataclass(frozen=True)
class Rule:
    """Candidate ``name`` runs for lengths below ``below`` (None: all the rest) and batches
    below ``batch_below`` (None: every batch), where no rule before it does."""

    below: int | None
    name: str
    batch_below: int | None = None

    def applies(self, batch: int, length: int) -> bool:
        return ((self.below is None or length < self.below)
                and (self.batch_below is None or batch < self.batch_below))


def first_rule(rules: Sequence[Rule], point: tuple[int, int]) -> int:
    """The index of the rule that runs at ``point`` (batch, length): the first that applies
    (the last rule applies everywhere)."""
    return next(i for i, r in enumerate(rules) if r.applies(*point))


@dataclass
class TuneResult:
    rules: list[Rule]
    table: dict[str, dict[str, float]]  # "batch x length" -> candidate -> p50 ms
    dim: str
    machine: dict[str, Any] = field(default_factory=dict)
    # "batch x length" -> the dispatching model's paired ratio to the original, where it
    # was timed itself (the shortest length: what its If costs)
    dispatch: dict[str, float] = field(default_factory=dict)
    batch_dim: str = ""  # (none where the model's batch is not dynamic: no rule bounds it)
    noise: float | None = None  # the default fusion's two sessions apart, at most

    def to_dict(self) -> dict[str, Any]:
        return {"runs": self.describe(), "dim": self.dim, "batch_dim": self.batch_dim,
                "rules": [{"below": r.below, "batch_below": r.batch_below,
                           "candidate": r.name} for r in self.rules],
                "table_ms": self.table, "dispatch_ratio": self.dispatch,
                "noise": self.noise, "machine": self.machine}

    def describe(self) -> str:
        parts = []
        for rule in self.rules:
            where = ([f"{self.batch_dim} < {rule.batch_below}"] if rule.batch_below else []) \
                + ([f"{self.dim} < {rule.below}"] if rule.below is not None else [])
            parts.append(f"{' and '.join(where) or 'else'}: {rule.name}")
        return "; ".join(parts)


# -- choosing --------------------------------------------------------------------------------

# A candidate replaces the original only when it is this much faster at every batch of a
# length, and the default fusion is kept over another form within this much of it: below
# that, the differences are the noise of one timing run (seen on 2-core machines: a form
# 3 % ahead while tuning was 27 % behind when timed again).
MARGIN = 0.03
DEFAULT = "fused"


def choose(table: Mapping[tuple[int, int], Mapping[str, float]],
           original: str = ORIGINAL, margin: float = MARGIN) -> list[Rule]:
    """Rules from timings: per length, the candidate with the lowest worst ratio to
    ``original`` over the batches, if that is below 1 - ``margin`` (else the original),
    the default fusion instead where it is within ``margin`` of it (even if it alone is not
    ``margin`` ahead of the original: a tuning run of the causal export picked two other
    forms by 3-4 % differences that a second timing read 1.09x of the original where the
    default fusion read 0.93x); consecutive lengths
    with one winner merged, the boundary at the geometric mean of the lengths on either
    side of it. A length the original wins between two that one candidate wins takes that
    candidate where it is within ``margin`` of the original there: switching to the
    original and back costs two Ifs for a difference that is noise."""
    lengths = sorted({length for _, length in table})
    winners, scores = [], []
    for length in lengths:
        rows = [times for (_, n), times in table.items() if n == length and original in times]
        names = sorted(set.intersection(*(set(r) for r in rows))) if rows else [original]
        score = {n: max(r[n] / r[original] for r in rows) if rows else 1.0 for n in names}
        best = min(names, key=lambda n: (score[n], n != DEFAULT, n))
        if score[best] > 1 - margin:
            best = original
        elif DEFAULT in score and score[DEFAULT] <= score[best] + margin:
            best = DEFAULT  # (within noise of the form ahead, itself not behind the original)
        winners.append(best)
        scores.append(score)
    for i in range(1, len(lengths) - 1):
        around = winners[i - 1]
        if winners[i] == original and winners[i + 1] == around != original \
                and scores[i].get(around, math.inf) <= 1 + margin:
            winners[i] = around
    rules: list[Rule] = []
    for i, (length, name) in enumerate(zip(lengths, winners, strict=True)):
        if i + 1 < len(lengths) and winners[i + 1] == name:
            continue
        below = (None if i + 1 == len(lengths)
                 else int(round(math.sqrt(length * lengths[i + 1]))))
        rules.append(Rule(below, name))
    return rules


def choose_by_batch(table: Mapping[tuple[int, int], Mapping[str, float]],
                    original: str = ORIGINAL, margin: float = MARGIN) -> list[Rule]:
    """Rules from timings, batch by batch: ``choose`` over each batch's lengths alone, then
    batches with the same rules taken together (the boundary at the geometric mean of the
    batches on either side), so that a form that wins at batch 1 and loses at batch 32 runs
    where it wins (one rule list for all where every batch chose the same). A batch keeps
    rules of its own only where they gain more than twice ``margin`` over ``choose``'s rules
    for all batches at one of its points: each split is one more If deep for the batches
    after it, and a noise-sized gain is not worth that."""
    common = choose(table, original, margin)
    groups: list[tuple[list[int], list[Rule]]] = []
    for batch in sorted({b for b, _ in table}):
        mine = {p: t for p, t in table.items() if p[0] == batch}
        rules = choose(mine, original, margin)
        if not any(_ratio(t, common, p, original) - _ratio(t, rules, p, original) > 2 * margin
                   for p, t in mine.items()):
            rules = common
        if groups and groups[-1][1] == rules:
            groups[-1][0].append(batch)
        else:
            groups.append(([batch], rules))
    out: list[Rule] = []
    for i, (batches, rules) in enumerate(groups):
        bound = (None if i + 1 == len(groups)
                 else int(round(math.sqrt(batches[-1] * groups[i + 1][0][0]))))
        out += [Rule(r.below, r.name, bound) for r in rules]
    return out


def _ratio(times: Mapping[str, float], rules: list[Rule], point: tuple[int, int],
           original: str) -> float:
    name = rules[first_rule(rules, point)].name
    return times.get(name, math.inf) / times[original]


def settle(ratios: Mapping[tuple[int, int], Mapping[str, float]], rules: list[Rule],
           probe: Mapping[tuple[int, int], float], original: str = ORIGINAL,
           margin: float = MARGIN) -> tuple[list[Rule], str]:
    """The rules to write, given ``probe``: the dispatching model's ratio to the original
    where it was timed itself (the grid's shortest length, every batch). Its If costs a
    constant time, which shows most there and which the candidates' own timings do not hold.
    The rules stand unless the probe finds the dispatch more than ``margin`` slower than the
    original. Then a candidate alone may replace them if it gives up nothing the dispatch
    gains elsewhere (within ``margin`` of the dispatch's branch at every other point): one
    within ``margin`` of the original everywhere (the fastest overall of those), else the
    least slow at its worst if that is less slow than the dispatch. Returns the rules and,
    where they changed, a sentence saying why."""
    slow = max(probe.values(), default=1.0)
    if len(rules) == 1 or slow <= 1 + margin:
        return rules, ""
    points = [p for p, row in ratios.items() if original in row]
    rule_at = {p: rules[first_rule(rules, p)].name for p in points}
    dispatched = {p: probe.get(p, ratios[p].get(rule_at[p], math.inf)) for p in points}
    options = {name: {p: ratios[p][name] for p in points}
               for name in sorted({n for row in ratios.values() for n in row} - {original})
               if all(name in ratios[p] and (p in probe or ratios[p][name]
                                             <= dispatched[p] + margin) for p in points)}
    fits = [k for k in options if max(options[k].values()) <= 1 + margin]
    if fits:
        best = min(fits, key=lambda k: sum(math.log(v) for v in options[k].values()))
    else:
        best = min(options, key=lambda k: max(options[k].values()), default="")
        if not best or max(options[best].values()) >= max(dispatched.values()):
            return rules, ""
    return [Rule(None, best)], (
        f"the dispatch ran {slow:.2f}x the original at the shortest length (its If); {best} "
        f"alone {'stays within' if fits else 'is less slow at its worst, though not within'} "
        f"{margin:.0%} of the original and gives up nothing the dispatch gained: {best} alone")
