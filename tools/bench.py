"""One benchmark for every attention variant: mha-onnx's fused graph against its peers.

    .venv/bin/python -m tools.benchmark attention [--seq-lens 128,512,2048,8192] [--out FILE]
                                    [--plot docs/bench.png] [--threads 2] [--iters 5]

Variants: self-attention, cross-attention, key padding (the last 25 % of keys padded) and
causal, base preset, batch 1, fp32, on the CPU. Peers, measured side by side at each length:
the unfused export, onnxscript's ``optimize_for_ort`` output, the ONNX ``Attention`` op
(mha-onnx ``--target onnx``), PyTorch eager ``nn.MultiheadAttention`` and
``F.scaled_dot_product_attention`` (with the same projections), and the roofline: the
layer's FLOPs at the measured matmul GFLOP/s. Every point runs in its own child process
(median of at least ``--iters`` runs and ``--min-time`` seconds after two warm-ups; memory =
RSS growth while running).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from mha_onnx.config import MhaConfig, load_preset
from mha_onnx.profile import ProfileConfig, attention_flops, profile_models
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.table import human_bytes
from tools import suite

VARIANTS = {
    "self": dict(attention="self", mask="none"),
    "cross": dict(attention="cross", mask="none"),
    "key-padding": dict(attention="self", mask="key-padding"),
    "causal": dict(attention="self", mask="causal"),
}
PAD = 0.25
FUSED = "mha-onnx fused"
ORT_PEERS = ["unfused export", "onnxscript optimize_for_ort", "ONNX Attention (opset 23)"]
TORCH_PEERS = ["torch nn.MultiheadAttention", "torch F.sdpa"]


# -- PyTorch eager peers (run in a child process: python -m tools.bench --torch-worker) -----

def torch_worker(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from mha_onnx.profile.worker import peak_rss, reset_peak_rss, timed_loop
    from mha_onnx.profile.worker import rss as worker_rss  # psutil or /proc

    torch.set_num_threads(spec["threads"])
    cfg = MhaConfig.from_dict(spec["config"])
    seq = spec["seq"]
    padded = int(round(seq * PAD)) if cfg.mask == "key-padding" else 0
    torch.manual_seed(0)
    x = torch.randn(1, seq, cfg.d_model)
    kv = torch.randn(1, seq, cfg.d_model) if cfg.attention == "cross" else x
    pad_mask = torch.zeros(1, seq, dtype=torch.bool)
    if padded:
        pad_mask[:, seq - padded:] = True
    if spec["peer"] == "torch nn.MultiheadAttention":
        mha = torch.nn.MultiheadAttention(cfg.d_model, cfg.num_heads, batch_first=True).eval()
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1) if cfg.mask == "causal" else None

        def run():
            return mha(x, kv, kv, key_padding_mask=pad_mask if padded else None,
                       attn_mask=causal, need_weights=False, is_causal=cfg.mask == "causal")[0]
    else:
        proj = [torch.nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4)]
        h, dh = cfg.num_heads, cfg.d_k

        def split(t):
            return t.view(1, -1, h, dh).transpose(1, 2)

        keep = (~pad_mask)[:, None, None, :] if padded else None

        def run():
            q, k, v = split(proj[0](x)), split(proj[1](kv)), split(proj[2](kv))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                                 is_causal=cfg.mask == "causal")
            return proj[3](out.transpose(1, 2).reshape(1, seq, cfg.d_model))
    with torch.inference_mode():
        run()
        rss = worker_rss()
        reset_peak_rss()
        (times,) = timed_loop([run], warmup=1, iters=spec["iters"], min_time=spec["min_time"])
    return {"times": times, "run_rss": max(0, peak_rss() - rss)}


def run_torch(peer: str, cfg: MhaConfig, seq: int, threads: int, iters: int,
              min_time: float) -> dict:
    spec = {"peer": peer, "config": cfg.to_dict(), "seq": seq, "threads": threads,
            "iters": iters, "min_time": min_time}
    done = subprocess.run([sys.executable, "-m", "tools.bench", "--torch-worker"],
                          input=json.dumps(spec), capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the ORT graphs --------------------------------------------------------------------------

def build_graphs(cfg: MhaConfig, folder: Path) -> dict[str, str]:
    import onnx
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    from mha_onnx.export.mha import export_model
    from mha_onnx.graph.files import write_model
    from mha_onnx.rewrite import fuse_model

    base = folder / "unfused.onnx"
    export_model(cfg, base)
    original = onnx.load(base)
    paths = {"unfused export": str(base)}
    for label, target in ((FUSED, "ort"), ("ONNX Attention (opset 23)", "onnx")):
        fused, _, _ = fuse_model(original, FormPolicy(target=target))
        path = folder / f"{target}.onnx"
        write_model(fused, path, force=True)
        paths[label] = str(path)
    graph = ir.from_proto(onnx.load(base))
    optimize_for_ort(graph)
    path = folder / "onnxscript.onnx"
    ir.save(graph, path)
    paths["onnxscript optimize_for_ort"] = str(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = suite.parser(__doc__)
    parser.add_argument("--seq-lens", default="128,512,2048,8192")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iters", type=int, default=5, help="at least this many timed runs")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.torch_worker:
        print(json.dumps(torch_worker(json.loads(sys.stdin.read()))))
        return 0
    suite.quiet()
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    results: dict[str, dict[int, dict[str, dict]]] = {}
    roofline = None
    for variant in args.variants.split(","):
        cfg = load_preset("base").replace(**VARIANTS[variant])
        results[variant] = {}
        with suite.scratch("attention") as folder:
            paths = build_graphs(cfg, folder)
            by_path = {v: k for k, v in paths.items()}
            for seq in seq_lens:
                row: dict[str, dict] = {}
                config = ProfileConfig(seq_lens=(seq,), iters=args.iters, warmup=2,
                                       min_time=args.min_time,
                                       threads=args.threads, op_breakdown=False,
                                       memory_check=False,
                                       pad_fraction=PAD if cfg.mask == "key-padding" else 0.0)
                report = profile_models(list(paths.values()), config)
                roofline = report.roofline_gflops.get("cpu float32", roofline)
                for p in report.points:
                    row[by_path[p.model]] = ({"error": p.error} if p.error else
                                             {"ms": p.p50_ms, "mem": p.run_rss_bytes})
                for peer in TORCH_PEERS:
                    raw = run_torch(peer, cfg, seq, args.threads, args.iters, args.min_time)
                    row[peer] = raw if "error" in raw else {
                        "ms": float(np.median(raw["times"]) * 1e3), "mem": raw["run_rss"]}
                kept = seq - int(round(seq * PAD)) if cfg.mask == "key-padding" else seq
                flops = attention_flops(cfg, 1, seq, seq, kept)
                row["roofline"] = {"ms": flops / (roofline * 1e9) * 1e3, "mem": None}
                results[variant][seq] = row
                print(variant, seq, {k: round(v.get("ms", -1), 2) for k, v in row.items()}, flush=True)
    suite.emit(render(results, roofline, args, suite.command("attention", argv)), args.out)
    if args.plot:
        plot(results, args.plot)
    return 0


def render(results, roofline, args, command: str) -> list[str]:
    peers = [FUSED, *ORT_PEERS, *TORCH_PEERS]
    lines = [
        suite.measured(command, f"{args.threads} threads, base preset, batch 1, fp32, median "
                       f"of >= {args.iters} runs and >= {args.min_time:g} s per point after 2 "
                       f"warm-ups, key padding pads the last {int(PAD * 100)} % of keys")
        + f" Matmul roofline {roofline:.0f} GFLOP/s (measured in the same run).",
        "",
        "Cells: p50 ms / peak working memory; the ratio is the fused time over the best peer's "
        "(below 1: mha-onnx is faster). Roofline: the layer's FLOPs (attended pairs only) at "
        "the matmul roofline.",
        "",
        "| variant | L | " + " | ".join(peers) + " | roofline ms | fused / best peer | fused % of roofline |",
        "|---|---|" + "---|" * (len(peers) + 3),
    ]
    for variant, rows in results.items():
        for seq, row in rows.items():
            cells = []
            for peer in peers:
                r = row.get(peer, {})
                cells.append(r.get("error", "-")[:30] if "ms" not in r else
                             f"{r['ms']:.1f} / {human_bytes(r['mem'])}")
            others = [row[p]["ms"] for p in peers[1:] if "ms" in row.get(p, {})]
            fused = row.get(FUSED, {}).get("ms")
            ratio = f"{fused / min(others):.2f}" if fused and others else "-"
            pct = f"{100 * row['roofline']['ms'] / fused:.0f} %" if fused else "-"
            lines.append(f"| {variant} | {seq} | " + " | ".join(cells)
                         + f" | {row['roofline']['ms']:.1f} | {ratio} | {pct} |")
    return lines


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), squeeze=False)
    for ax, (variant, rows) in zip(axes[0], results.items(), strict=True):
        seqs = sorted(rows)
        for peer in [FUSED, *ORT_PEERS, *TORCH_PEERS, "roofline"]:
            ys = [rows[s].get(peer, {}).get("ms") for s in seqs]
            pts = [(s, y) for s, y in zip(seqs, ys, strict=True) if y]
            if pts:
                style = "k--" if peer == "roofline" else ("o-" if peer == FUSED else ".-")
                ax.plot(*zip(*pts, strict=True), style, label=peer, linewidth=2.5 if peer == FUSED else 1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(variant)
        ax.set_xlabel("sequence length")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("p50 latency (ms)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
