"""A profile written out: CSV rows and a log-log plot of latency and memory against the
sequence length. Neither replaces an existing file without ``force``."""

from __future__ import annotations

import csv
from pathlib import Path

from mha_onnx.graph.files import atomic_path
from mha_onnx.profile.report import Point, ProfileReport


def write_csv(report: ProfileReport, path: str | Path, *, force: bool = False) -> None:
    rows = [{k: v for k, v in p.to_dict().items() if k != "top_ops"} for p in report.points]
    fields = [f for f in Point.__dataclass_fields__ if f != "top_ops"]
    fields += list(dict.fromkeys(k for row in rows for k in row if k not in fields))  # (notes
    with atomic_path(path, force=force) as tmp, tmp.open("w", newline="") as handle:  # a row
        writer = csv.DictWriter(handle, fieldnames=fields)  # adds where a figure asks one)
        writer.writeheader()
        writer.writerows(rows)


def log_axes(*axes_and_labels) -> None:
    """Log-log axes over the sequence length, one (axes, y label) pair each."""
    for ax, ylabel in axes_and_labels:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)


def plot(report: ProfileReport, path: str | Path, *, force: bool = False) -> None:
    """Latency and memory vs sequence length (log-log), one line per model x provider x
    batch x threads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[tuple[str, str, int, int], list[Point]] = {}
    for p in report.points:
        if p.error is None:
            series.setdefault((Path(p.model).stem, p.provider, p.batch, p.threads), []).append(p)
    for (model, provider, batch, threads), pts in series.items():
        pts.sort(key=lambda p: p.seq_len)
        label = f"{model} {provider} b{batch} t{threads}"
        x = [p.seq_len for p in pts]
        ax_t.plot(x, [p.p50_ms for p in pts], marker="o", label=label)
        memory = [(p.seq_len, p.memory / 2**20) for p in pts if p.memory is not None]
        if memory:
            ax_m.plot(*zip(*[(s, max(m, 1e-3)) for s, m in memory], strict=True), marker="o",
                      label=label)
    log_axes((ax_t, "p50 latency (ms)"), (ax_m, "peak working memory (MiB)"))
    ax_t.legend(fontsize=7)
    fig.suptitle(f"mha-onnx profile ({report.machine.get('processor')})", fontsize=9)
    fig.tight_layout()
    with atomic_path(path, force=force) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
