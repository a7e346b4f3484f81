"""``report``: profiles from several machines and providers side by side, to choose hardware.

Each ``profile --json`` carries its machine (CPU model and cores, GPU name and memory, ORT
version), provider and threads, and a schema version. The report puts, for every model x
batch x length, one column per target (machine x provider x threads): p50 latency, tokens/s,
the fraction of that machine's own matmul roofline and memory; and draws latency and
throughput against the length, one line per target.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha_onnx.errors import InputSpecError
from mha_onnx.graph.files import atomic_path, check_readable, prepare_output
from mha_onnx.profile.report import short_names
from mha_onnx.table import human_bytes

MIN_SCHEMA = 2


@dataclass(frozen=True)
class Target:
    """Where points ran: a machine (by its description), a provider and the intra-op
    threads (two profiles of one machine at 1 and 2 threads are two columns, not one)."""

    machine: str
    provider: str
    threads: int | None = None

    @property
    def label(self) -> str:
        threads = "" if self.threads is None else f" / {self.threads} threads"
        return f"{self.machine} / {self.provider}{threads}"


@dataclass(frozen=True)
class MergedReport:
    sources: tuple[str, ...]
    targets: tuple[Target, ...]
    rows: tuple[dict[str, Any], ...]  # model, run, batch, seq_len; per target label a cell

    def to_dict(self) -> dict[str, Any]:
        return {"sources": list(self.sources), "targets": [t.label for t in self.targets],
                "rows": list(self.rows)}

    def markdown(self) -> str:
        head = ["model", "run", "batch", "L"] + [t.label for t in self.targets]
        lines = [f"Profiles merged {datetime.date.today()} by `mha-onnx report` from "
                 + ", ".join(f"`{Path(s).name}`" for s in self.sources) + ".",
                 "", "Cells: p50 ms / tokens per s / % of that machine's matmul roofline "
                 "(decode points, whose L is the cached context: % of its memory bandwidth, "
                 "`bw`; `>100%?` where the probe measured less than the run achieved) / "
                 "peak memory (the profiling process's resident set, or the GPU's). One "
                 "column per machine, provider and thread count; a forward run (L tokens) "
                 "and a decode step (one token after L cached) of one model are rows of "
                 "their own.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in self.rows:
            cells = [row["model"], row["run"], str(row["batch"]), str(row["seq_len"] or "-")]
            cells += [_cell(row.get(t.label)) for t in self.targets]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def render(self) -> str:
        return self.markdown()


def _cell(point: dict[str, Any] | None) -> str:
    if not point:
        return "-"
    if point.get("error"):
        return "error"
    roof, bandwidth = point.get("roofline_fraction"), point.get("bandwidth_fraction")
    fraction = "-" if roof is None else _share(roof)
    if roof is None and bandwidth is not None:  # a decode step: what it reads is the ceiling
        fraction = f"{_share(bandwidth)} bw"
    memory = point.get("device_bytes") if point.get("device_bytes") is not None else \
        point.get("peak_rss_bytes")
    tokens = point.get("tokens_per_s")
    return (f"{point['p50_ms']:.2f} ms / {'-' if tokens is None else f'{tokens:,.0f}'} / "
            f"{fraction} / {'-' if memory is None else human_bytes(memory)}")


def _share(value: float) -> str:
    return ">100%?" if value > 1.0 else f"{100 * value:.0f} %"


def _machine(data: dict[str, Any]) -> str:
    machine = data.get("machine", {})
    gpu = machine.get("gpu")
    isa = f" ({machine['isa']})" if machine.get("isa") else ""
    base = f"{machine.get('processor', '?')}{isa} x{machine.get('cpus', '?')}"
    return f"{base} + {gpu['name']}" if gpu else base


def load_profile(path: str | Path) -> dict[str, Any]:
    check_readable(path, "profile")
    try:
        data = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputSpecError(f"{path} is not a profile JSON ({exc})",
                             hint="write one with mha-onnx profile ... --json > FILE") from exc
    if not isinstance(data, dict) or int(data.get("schema", 0)) < MIN_SCHEMA:
        raise InputSpecError(f"{path} is not a profile JSON of schema >= {MIN_SCHEMA}",
                             hint="profile again with this version: mha-onnx profile ... --json")
    return data


def merge_profiles(paths: list[str | Path]) -> MergedReport:
    """One row per model x run (forward, decode step) x batch x length, one column per
    machine x provider x threads."""
    if not paths:
        raise InputSpecError("no profile given", hint="mha-onnx report A.json B.json -o R.md")
    targets: dict[Target, None] = {}
    rows: dict[tuple, dict[str, Any]] = {}
    for path in paths:
        data = load_profile(path)
        machine = _machine(data)
        # each model by as much of its path as tells it from the file's others (two models
        # both named model.onnx, each in a folder of its own, were merged into one row)
        names = short_names(p["model"] for p in data.get("points", []))
        for point in data.get("points", []):
            target = Target(machine, point["provider"], point.get("threads"))
            targets.setdefault(target)
            run = "decode step" if data.get("decode") else "forward"  # (never one row)
            key = (names[str(point["model"])], run, point["batch"], point["seq_len"])
            row = rows.setdefault(key, {"model": key[0], "run": run, "batch": key[2],
                                        "seq_len": key[3]})
            row[target.label] = point
    ordered = sorted(rows.values(),
                     key=lambda r: (r["model"], r["run"], r["batch"], r["seq_len"]))
    return MergedReport(tuple(str(p) for p in paths), tuple(targets), tuple(ordered))


def write_report(report: MergedReport, output: str | Path, plot: str | Path | None = None, *,
                 force: bool = False) -> None:
    prepare_output(output, force=force)
    if plot:
        prepare_output(plot, force=force)
    with atomic_path(output, force=force) as tmp:
        tmp.write_text(report.markdown())
    if plot:
        _plot(report, plot, force=force)


def _plot(report: MergedReport, path: str | Path, *, force: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mha_onnx.profile.output import log_axes

    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4.5))
    for target in report.targets:
        series: dict[tuple[str, int], list[tuple[int, dict]]] = {}
        for row in report.rows:
            point = row.get(target.label)
            if point and not point.get("error") and point.get("tokens_per_s") is not None:
                series.setdefault((row["model"], row["run"], row["batch"]), []).append(
                    (row["seq_len"], point))
        for (model, run, batch), pts in series.items():
            pts.sort(key=lambda x: x[0])
            label = f"{target.label}: {model} {run} b{batch}"
            ax_t.plot([x for x, _ in pts], [p["p50_ms"] for _, p in pts], marker="o", label=label)
            ax_r.plot([x for x, _ in pts], [p["tokens_per_s"] for _, p in pts], marker="o", label=label)
    log_axes((ax_t, "p50 latency (ms)"), (ax_r, "tokens / s"))
    ax_t.legend(fontsize=6)
    fig.suptitle("mha-onnx: targets side by side", fontsize=9)
    fig.tight_layout()
    with atomic_path(path, force=force) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
