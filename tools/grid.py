"""The fused graph against its unfused original over the shapes users run: batch x length for
key padding, causal and no mask (this project's export, base preset) and a BERT-style Hugging
Face encoder with padding; interleaved in one process (median of >= --min-time s per model),
at each thread count. Points whose unfused working set cannot fit, or whose estimated run
exceeds --max-seconds, are skipped and say so.

    .venv/bin/python -m tools.benchmark grid [--batches 1,8,32,64] [--seq-lens 16,...,8192]
        [--threads 1,2] [--variants kp,causal,none,bert] [--out docs/grid.md]
        [--heatmap docs/grid.png] [--json FILE]

The numbers and the command that made them go to docs/history/bench-notebook.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx

from mha_onnx.config import MhaConfig, load_preset
from mha_onnx.export.mha import export_model
from mha_onnx.graph.files import write_model
from mha_onnx.profile import ProfileConfig, attention_flops, profile_models
from mha_onnx.profile.memory import available_memory, estimate_bytes
from mha_onnx.profile.roofline import cpu_name
from mha_onnx.rewrite import fuse_model
from tools import suite

PAD = 0.25
VARIANTS = {"kp": "key-padding", "causal": "causal", "none": "none"}
BERT_LAYERS, BERT_HIDDEN, BERT_HEADS = 2, 512, 8


def _own(mask: str, folder: Path) -> tuple[str, str, MhaConfig]:
    cfg = load_preset("base").replace(mask=mask)
    unfused = folder / f"{mask}.onnx"
    export_model(cfg, unfused, force=True)
    fused = folder / f"{mask}.fused.onnx"
    write_model(fuse_model(onnx.load(unfused))[0], fused, force=True)
    return str(unfused), str(fused), cfg


def _bert(folder: Path) -> tuple[str, str, MhaConfig]:
    """A BERT-style encoder (2 layers, hidden 512, 8 heads) with an attention mask."""
    import torch
    import transformers as tf

    from tests.models import HfWrap, export

    config = tf.BertConfig(vocab_size=1000, hidden_size=BERT_HIDDEN, num_hidden_layers=BERT_LAYERS,
                           num_attention_heads=BERT_HEADS, intermediate_size=4 * BERT_HIDDEN,
                           max_position_embeddings=8192, attn_implementation="eager")
    torch.manual_seed(0)
    model = HfWrap(tf.BertModel(config).eval(), ["input_ids", "attention_mask"],
                    "last_hidden_state")
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1)
    proto = export(model, (torch.randint(0, 999, (2, 6)), torch.ones(2, 6, dtype=torch.int64)),
                   {"args": ({0: batch, 1: seq}, {0: batch, 1: seq})},
                   names=["input_ids", "attention_mask"])
    unfused, fused = folder / "bert.onnx", folder / "bert.fused.onnx"
    onnx.save(proto, unfused)
    write_model(fuse_model(proto)[0], fused, force=True)
    cfg = MhaConfig(d_model=BERT_HIDDEN, num_heads=BERT_HEADS, mask="key-padding")
    return str(unfused), str(fused), cfg


def _feasible(path: str, cfg: MhaConfig, batch: int, seq: int, layers: int,
              max_seconds: float, gflops: float) -> str:
    """'' when the point can run; else why it is skipped."""
    need = estimate_bytes(onnx.load(path, load_external_data=False), batch, seq) \
        or 2 * batch * cfg.num_heads * seq * seq * 4 * layers
    if need > 0.6 * available_memory():
        return "memory"
    seconds = layers * attention_flops(cfg, batch, seq, seq) / (gflops * 1e9)
    return "time" if seconds > max_seconds else ""


def run(args: argparse.Namespace) -> dict:
    results: dict = {"rows": [], "threads": args.threads, "machine": cpu_name()}
    gflops = args.gflops
    with suite.scratch("grid") as folder:
        for variant in args.variants:
            unfused, fused, cfg = _bert(folder) if variant == "bert" else _own(VARIANTS[variant], folder)
            layers = BERT_LAYERS if variant == "bert" else 1
            pad = PAD if cfg.mask == "key-padding" else 0.0
            for threads in args.threads:
                for batch in args.batches:
                    for seq in args.seq_lens:
                        skip = _feasible(unfused, cfg, batch, seq, layers, args.max_seconds, gflops)
                        row = {"variant": variant, "threads": threads, "batch": batch, "seq": seq}
                        if skip:
                            results["rows"].append({**row, "skipped": skip})
                            continue
                        config = ProfileConfig(batches=(batch,), seq_lens=(seq,), threads=threads,
                                               iters=3, min_time=args.min_time, warmup=2,
                                               op_breakdown=False, memory_check=False,
                                               interleave=True, pad_fraction=pad)
                        report = profile_models([unfused, fused], config)
                        p50 = {p.model: p.p50_ms for p in report.points}
                        results["rows"].append({**row, "unfused_ms": p50[unfused],
                                                "fused_ms": p50[fused],
                                                "ratio": p50[fused] / p50[unfused]})
                        print(json.dumps(results["rows"][-1]), flush=True)
    return results


def render(results: dict, command: str) -> list[str]:
    lines = [suite.measured(command, "fused p50 / unfused p50, both timed in turn in one "
                            "process (median of the runs of at least the given time per "
                            f"model); key padding pads the last {int(PAD * 100)} % of keys; "
                            "'-' = skipped (memory: the unfused graph cannot fit; time: too "
                            "long a run)"), ""]
    for variant in dict.fromkeys(r["variant"] for r in results["rows"]):
        for threads in results["threads"]:
            rows = [r for r in results["rows"] if r["variant"] == variant and r["threads"] == threads]
            seqs = sorted({r["seq"] for r in rows})
            lines += [f"**{variant}**, {threads} thread(s): fused / unfused", "",
                      "| batch \\ L | " + " | ".join(str(s) for s in seqs) + " |",
                      "|---|" + "---|" * len(seqs)]
            for batch in sorted({r["batch"] for r in rows}):
                cells = []
                for seq in seqs:
                    r = next((x for x in rows if x["batch"] == batch and x["seq"] == seq), {})
                    cells.append(f"{r['ratio']:.2f}" if "ratio" in r else "-")
                lines.append(f"| {batch} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def heatmap(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [(v, t) for v in dict.fromkeys(r["variant"] for r in results["rows"])
              for t in results["threads"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False)
    for ax, (variant, threads) in zip(axes[0], panels, strict=True):
        rows = [r for r in results["rows"] if r["variant"] == variant and r["threads"] == threads]
        seqs, batches = sorted({r["seq"] for r in rows}), sorted({r["batch"] for r in rows})
        grid = np.full((len(batches), len(seqs)), np.nan)
        for r in rows:
            if "ratio" in r:
                grid[batches.index(r["batch"]), seqs.index(r["seq"])] = r["ratio"]
        image = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.5, vmax=1.5, aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(seqs)), [str(s) for s in seqs], fontsize=6, rotation=45)
        ax.set_yticks(range(len(batches)), [str(b) for b in batches], fontsize=6)
        ax.set_title(f"{variant}, {threads} thr", fontsize=8)
        ax.set_xlabel("L", fontsize=7)
    axes[0][0].set_ylabel("batch", fontsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="fused / unfused")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = suite.parser(__doc__, threads=(1, 2), json_out=True)
    parser.add_argument("--batches", type=suite.ints, default=(1, 8, 32, 64))
    parser.add_argument("--seq-lens", type=suite.ints,
                        default=(16, 32, 64, 128, 256, 512, 2048, 8192))
    parser.add_argument("--variants", type=lambda t: t.split(","),
                        default=["kp", "causal", "none", "bert"])
    parser.add_argument("--max-seconds", type=float, default=4.0, help="skip longer runs")
    parser.add_argument("--gflops", type=float, default=60.0, help="for the run-time estimate")
    parser.add_argument("--heatmap", default=None)
    args = parser.parse_args(argv)
    suite.quiet()
    results = run(args)
    suite.emit(render(results, suite.command("grid", argv)), args.out, args.json_path, results)
    if args.heatmap:
        heatmap(results, args.heatmap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
