"""What a tuning may cost and what it must earn (see :mod:`mha_onnx.tune.rules`):

- the noise: the default fusion timed twice in the grid, in two sessions of its own
  (``AGAIN``); the largest relative difference of their ratios over the grid is the margin a
  choice must beat (never less than ``tune.MARGIN``);
- the default kept: where the rules gain over the default fusion alone by no more than the
  noise at every point, the default fusion alone is written, and said;
- the size: a tuned model holds one copy of every weight its candidates share, and the
  weights they do not share (the original's Q, K and V beside a fusion's packed ones; the
  candidates past the second, whose weights each If's else graph holds again) cost bytes.
  The rules are restricted to the one or two candidates that gain most within ``max_size``
  times the original's bytes (by the candidates' own initializers, stored once where equal);
- the time: the grid's points in two passes, the shortest lengths first with every
  candidate, then the rest with the candidates that were within the noise of the best at
  one point of the first (and the original, the default fusion and its twin); points whose
  estimate (the first pass's time per token of the default fusion, times the candidates and
  runs) would pass the budget left are dropped, largest first, and said.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

import onnx

from mha_onnx.tune.rules import DEFAULT, MARGIN, ORIGINAL, Rule, first_rule

AGAIN = "fused (again)"  # the default fusion's twin: its second session, for the noise


def noise(ratios: Mapping[tuple[int, int], Mapping[str, float]]) -> float:
    """The largest relative difference between the default fusion's two sessions."""
    diffs = [abs(math.log(row[AGAIN] / row[DEFAULT])) for row in ratios.values()
             if AGAIN in row and DEFAULT in row and row[DEFAULT] > 0 and row[AGAIN] > 0]
    return math.exp(max(diffs)) - 1 if diffs else 0.0


def margin_of(measured: float) -> float:
    return max(MARGIN, measured)


def without_twin(ratios: Mapping) -> dict:
    return {p: {n: v for n, v in row.items() if n != AGAIN} for p, row in ratios.items()}


def gains_over_default(ratios: Mapping, rules: Sequence[Rule], margin: float) -> bool:
    """Do ``rules`` run something faster than the default fusion by more than ``margin``
    at one point at least?"""
    for point, row in ratios.items():
        name = rules[first_rule(rules, point)].name
        if DEFAULT in row and name in row and row[name] < row[DEFAULT] * (1 - margin):
            return True
    return False


def weight_keys(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """Each initializer of every graph: name -> (content digest, bytes)."""
    from mha_onnx.graph.walk import all_graphs

    out = {}
    for graph in all_graphs(model.graph):
        for tensor in graph.initializer:
            data = tensor.SerializeToString()
            out[tensor.name] = (hashlib.sha1(data).hexdigest(), len(data))
    return out


def bytes_of(names: Sequence[str], keys: Mapping[str, Mapping[str, tuple[str, int]]]) -> int:
    """The weights of candidates ``names`` stored once where equal (name and content);
    past the second candidate, each is held again (tune.dispatch's else graphs)."""
    held: dict[tuple[str, str], int] = {}
    extra = 0
    for depth, name in enumerate(names):
        for weight, (digest, size) in keys[name].items():
            if depth >= 2:
                extra += size
            held.setdefault((weight, digest), size)
    return sum(held.values()) + extra


def within_size(ratios: Mapping, rules: list[Rule], models: Mapping[str, onnx.ModelProto],
                choose: Callable[..., list[Rule]], max_size: float, margin: float
                ) -> tuple[list[Rule], str]:
    """``rules``, or rules over the one or two candidates that gain most (the geometric mean
    of the chosen ratio over the grid) whose weights fit ``max_size`` x the original's; the
    default fusion alone where nothing else fits. Returns the rules and what changed."""
    keys = {name: weight_keys(model) for name, model in models.items() if name != AGAIN}
    limit = max_size * bytes_of([ORIGINAL], keys)
    used = list(dict.fromkeys(r.name for r in rules))
    if bytes_of(used, keys) <= limit:
        return rules, ""
    best, best_score = [Rule(None, DEFAULT)], math.inf
    names = [n for n in keys if all(n in row for row in ratios.values())]
    for pair in itertools.chain(((n,) for n in names), itertools.combinations(names, 2)):
        if bytes_of(list(pair), keys) > limit:
            continue
        baseline = DEFAULT if DEFAULT in pair else pair[0]
        subset = {p: {n: row[n] for n in (*pair, ORIGINAL) if n in row}
                  for p, row in ratios.items()}
        chosen = choose(subset, baseline, margin) if len(pair) > 1 else [Rule(None, pair[0])]
        score = sum(math.log(row[chosen[first_rule(chosen, p)].name])
                    for p, row in ratios.items())
        if score < best_score - 1e-12:
            best, best_score = chosen, score
    grown = bytes_of(used, keys) / bytes_of([ORIGINAL], keys)
    return best, (f"the rules over {', '.join(used)} would make the tuned model "
                  f"{grown:.2f}x the original's weights, past --tune-max-size {max_size:g}x: "
                  f"{'; '.join(f'{r.name}' for r in best)} instead (what fits and gains most)")


def split_grid(points: Sequence[tuple[int, int]]) -> tuple[list, list]:
    """(first pass: each batch's shortest length; second pass: the rest)."""
    shortest = {}
    for batch, length in points:
        shortest[batch] = min(shortest.get(batch, length), length)
    first = [p for p in points if p[1] == shortest[p[0]]]
    return first, [p for p in points if p not in first]


def survivors(ratios: Mapping, margin: float) -> set[str]:
    """The candidates within ``margin`` of the best at one point at least, with the
    original, the default fusion and its twin."""
    keep = {ORIGINAL, DEFAULT, AGAIN}
    for row in ratios.values():
        best = min(row.values())
        keep |= {n for n, v in row.items() if v <= best * (1 + margin)}
    return keep


def fit_budget(points: Sequence[tuple[int, int]], table: Mapping, candidates: int,
               runs: int, seconds_left: float) -> tuple[list, list]:
    """(points to time, points dropped): the second pass's points, largest first, kept
    while their estimated cost fits ``seconds_left`` (the default fusion's time per token
    at the largest point of the first pass, times the point's tokens, the candidates and
    the runs)."""
    timed = [(b * n, t[DEFAULT]) for (b, n), t in table.items() if DEFAULT in t and b * n]
    if not timed:
        return list(points), []
    tokens, ms = max(timed)
    per_token = ms / 1e3 / tokens
    keep, dropped, spent = [], [], 0.0
    for point in sorted(points, key=lambda p: p[0] * p[1]):
        cost = per_token * point[0] * point[1] * candidates * runs
        if spent + cost <= seconds_left:
            keep.append(point)
            spent += cost
        else:
            dropped.append(point)
    return keep, dropped
