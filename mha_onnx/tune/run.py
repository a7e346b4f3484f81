"""The tuning run: candidates fused and verified, timed on this machine, the dispatching model
verified over every interval and written (see :mod:`mha_onnx.tune.rules`)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from mha_onnx.errors import ConfigError, InputSpecError
from mha_onnx.graph import metadata
from mha_onnx.graph.files import prepare_output, read_model, write_model
from mha_onnx.graph.inputs import case_for, input_specs, split_dims
from mha_onnx.tune.dispatch import dispatch
from mha_onnx.tune.plan import (
    AGAIN,
    gains_over_default,
    margin_of,
    noise,
    within_size,
    without_twin,
)
from mha_onnx.tune.rules import (
    DEFAULT,
    ORIGINAL,
    TUNING,
    Rule,
    TuneConfig,
    TuneResult,
    choose,
    choose_by_batch,
    first_rule,
)
from mha_onnx.tune.timing import confirmed, settled, two_passes


def candidates(original: onnx.ModelProto
               ) -> tuple[dict[str, onnx.ModelProto], list[str], list]:
    """{name: model}: the original, the default fusion and one fusion per other form of
    each mask kind the model's blocks have (FormPolicy.candidates), each verified against
    the original (a form that fails verification is left out, said in the notes)."""
    from mha_onnx.rewrite import FormPolicy, fuse_model
    from mha_onnx.rewrite.check.cases import verification_cases
    from mha_onnx.rewrite.check.verify import verify

    fused, results, _ = fuse_model(original)
    kinds = {r.mask for r in results if r.status == "fused"}
    out, notes = {ORIGINAL: original, "fused": fused}, []
    for name, policy in FormPolicy().candidates(kinds).items():
        out[name] = fuse_model(original, policy)[0]
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


def tune_model(source: str | Path, output: str | Path, cfg: TuneConfig, *, force: bool = False,
               progress: Callable[[str], None] = lambda _: None) -> TuneReport:
    """Fuse every candidate, time them here, write the dispatching model (verified)."""
    from mha_onnx.rewrite.check.verify import verify
    from mha_onnx.runtime.machine import machine_info

    started = time.perf_counter()
    output = prepare_output(output, force=force)
    original = _the_original(source, progress)
    dim, batch_dim = _dims(original)
    grid_note = ""
    if not dim:  # (one point a batch: the model's own sizes; 0 stands for no length)
        cfg = replace(cfg, seq_lens=(0,))
    else:
        cfg, grid_note = _within_positions(original, cfg)
    progress("fusing and verifying the candidates")
    models, notes, results = candidates(original)
    notes = [grid_note] * bool(grid_note) + notes
    if len(models) == 1:
        raise ConfigError("--tune: no attention block was fused, nothing to choose")
    heads = max([int(r.details.get("heads", 1)) for r in results] + [1])
    rules, table, probe, measured, more = _time_and_choose(
        models, cfg, heads, dim, batch_dim, started, progress)
    notes += more
    result = TuneResult(rules, {f"{b}x{n}": t for (b, n), t in table.items()}, dim,
                        {**machine_info(), "threads": cfg.threads},
                        {f"{b}x{n}": round(r, 4) for (b, n), r in probe.items()}, batch_dim,
                        round(measured, 4))
    result, tuned = _within_budget(original, models, result, results, cfg, notes)
    check = verify(original, tuned, cases=_branch_cases(original, result.rules, table, dim))
    if not check.passed:
        raise ConfigError(f"the tuned model differs from the original: {check.first_failure()}",
                          hint="nothing was written; please report this model")
    notes.append(_size_note(original, tuned, cfg.max_size))
    write_model(tuned, output, force=force)
    return TuneReport(str(output), result, tuple(notes), time.perf_counter() - started)


def _time_and_choose(models: dict[str, onnx.ModelProto], cfg: TuneConfig, heads: int, dim: str,
                     batch_dim: str, started: float, progress: Callable[[str], None]):
    """Time every candidate (and the default twice, for the noise), keep what beats the default
    by more than the noise and fits the size budget; (rules, table, probe, noise, notes)."""
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mha_onnx_tune_") as tmp:
        paths = {}
        for n, (name, model) in enumerate(models.items()):
            paths[name] = str(Path(tmp) / f"c{n}.onnx")
            onnx.save(model, paths[name])
        paths[AGAIN] = str(Path(tmp) / "again.onnx")  # the default fusion, a second session
        shutil.copyfile(paths[DEFAULT], paths[AGAIN])
        table, ratios, timing_notes = two_passes(paths, cfg, heads, started, progress)
        notes += timing_notes
        if not table:
            raise ConfigError("--tune: every point of the grid was skipped",
                              hint="smaller --tune-batch / --tune-seq-lens")
        measured = noise(ratios)
        margin = margin_of(measured)
        ratios = without_twin(ratios)
        paths.pop(AGAIN)
        chosen = confirmed(paths, cfg, heads, ratios, batch_dim, progress, margin)
        chosen, why_size = _fits(ratios, chosen, models, batch_dim, cfg, margin)
        notes += [why_size] if why_size else []
        rules, why, probe = settled(dispatch(models, chosen, dim, batch_dim), paths, chosen,
                                    ratios, cfg, heads, progress, margin)
    notes += [why] if why else []  # one candidate alone instead
    notes.append(f"noise: the default fusion's two sessions read up to {measured:.1%} apart; "
                 f"a form replaces it only where it is more than {margin:.1%} faster")
    if rules == [Rule(None, DEFAULT)] and not why:
        notes.append("default kept: nothing beat the default fusion by more than the noise "
                     "(the output is the default fusion)")
    return rules, table, probe, measured, notes


def _within_budget(original: onnx.ModelProto, models: dict[str, onnx.ModelProto],
                   result: TuneResult, results, cfg: TuneConfig, notes: list[str]
                   ) -> tuple[TuneResult, onnx.ModelProto]:
    """The dispatching model, or the default fusion alone where it came past --tune-max-size."""
    tuned = assemble(original, models, result, results)
    if len(result.rules) > 1 and tuned.ByteSize() > cfg.max_size * original.ByteSize():
        notes.append(f"the dispatching model came to {tuned.ByteSize() / original.ByteSize():.2f}"
                     f"x the original's size, past --tune-max-size {cfg.max_size:g}x: the "
                     "default fusion alone instead")
        result = replace(result, rules=[Rule(None, DEFAULT)], dispatch={})
        tuned = assemble(original, models, result, results)
    return result, tuned


def _within_positions(original: onnx.ModelProto, cfg: TuneConfig) -> tuple[TuneConfig, str]:
    """The grid's lengths within the model's position table (input_roles.length_limit):
    those past it dropped, the longest that fits timed instead (a multiple of 64 within the
    table: BART's table holds two rows more than its positions)."""
    from mha_onnx.graph.roles import length_limit

    limit = length_limit(original)
    if limit is None or max(cfg.seq_lens) <= limit:
        return cfg, ""
    longest = limit // 64 * 64 if limit >= 64 else limit
    lengths = sorted({n for n in cfg.seq_lens if n <= longest} | {longest})
    return replace(cfg, seq_lens=tuple(lengths)), (
        f"lengths past the model's position table ({limit} rows) not timed: "
        f"{', '.join(str(n) for n in cfg.seq_lens if n > longest)}; {longest} timed instead")


def _fits(ratios, rules: list[Rule], models, batch_dim: str, cfg: TuneConfig, margin: float
          ) -> tuple[list[Rule], str]:
    """The rules within the size budget (tune.plan.within_size), or the default fusion alone
    where they gain nothing over it beyond ``margin``."""
    rules, why = within_size(ratios, rules, models, choose_by_batch if batch_dim else choose,
                             cfg.max_size, margin)
    if not gains_over_default(ratios, rules, margin):
        return [Rule(None, DEFAULT)], why
    return rules, why


def assemble(original: onnx.ModelProto, models: dict[str, onnx.ModelProto],
             result: TuneResult, results: list) -> onnx.ModelProto:
    """The dispatching model of ``result``'s rules over ``models``, with the original's
    metadata, the fusion's (each fused block labelled with the rules), the tuning table,
    where the PyTorch reference finds each weight, and the original kept (so that ``tune``
    can tune it again elsewhere: mha_onnx.graph.original)."""
    from mha_onnx.graph.original import record
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
    from mha_onnx.graph.original import restore

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


def _size_note(original: onnx.ModelProto, tuned: onnx.ModelProto, max_size: float) -> str:
    grown = tuned.ByteSize() / max(original.ByteSize(), 1)
    return f"size: {grown:.2f}x the original's (--tune-max-size {max_size:g}x)"


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
