"""Measure every fused form ORT offers for each attention variant, to choose the default.

    .venv/bin/python -m tools.fusion_forms [--seq-lens 512,2048,8192] [--out docs/fusion-forms.md]

For self/cross attention with no mask, key padding (25 % of keys padded) and causal masks it
exports the base preset, fuses it with each form (plus the unfused export and the ONNX
Attention op), and profiles all of them side by side: median latency and peak working
memory (RSS growth of a child process while running) per sequence length, batch 1.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import tempfile
from pathlib import Path

import onnx

from mha_onnx.config import load_preset
from mha_onnx.export import export_model
from mha_onnx.graphio import write_model
from mha_onnx.profile import ProfileConfig, profile_models
from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.lower_ort import Forms
from mha_onnx.table import human_bytes

VARIANTS = [
    ("self", "none", [("MultiHeadAttention", Forms())]),
    ("cross", "none", [("MultiHeadAttention", Forms())]),
    ("self", "key-padding", [("Loop(Compress) + MHA", Forms(key_padding="loop")),
                             ("MHA key_padding_mask", Forms(key_padding="mask")),
                             ("MHA dense bias", Forms(key_padding="bias"))]),
    ("cross", "key-padding", [("Loop(Compress) + MHA", Forms(key_padding="loop")),
                              ("MHA key_padding_mask", Forms(key_padding="mask"))]),
    ("self", "causal", [("GroupQueryAttention", Forms(causal="gqa")),
                        ("MHA unidirectional", Forms(causal="unidirectional")),
                        ("MHA causal bias", Forms(causal="bias"))]),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="512,2048,8192")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--out", default=None, help="write a markdown table here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    seq_lens = tuple(int(x) for x in args.seq_lens.split(","))
    lines = []
    with tempfile.TemporaryDirectory(prefix="mha_forms_") as folder:
        for attention, mask, forms in VARIANTS:
            cfg = load_preset("base").replace(attention=attention, mask=mask)
            base = Path(folder) / f"{attention}-{mask}.onnx"
            export_model(cfg, base)
            models = {"unfused export": str(base)}
            original = onnx.load(base)
            for label, policy in forms:
                fused, _, _ = fuse_model(original, forms=policy)
                path = Path(folder) / f"{attention}-{mask}-{policy.key_padding}-{policy.causal}.onnx"
                write_model(fused, path, force=True)
                models[label] = str(path)
            fused, _, _ = fuse_model(original, target="onnx")
            path = Path(folder) / f"{attention}-{mask}-onnx.onnx"
            write_model(fused, path, force=True)
            models["ONNX Attention (opset 23)"] = str(path)
            config = ProfileConfig(providers=(args.provider,), seq_lens=seq_lens, iters=args.iters,
                                   warmup=1, threads=args.threads, op_breakdown=False,
                                   pad_fraction=0.25 if mask == "key-padding" else 0.0,
                                   memory_check=False)
            report = profile_models(list(models.values()), config)
            by_path = {v: k for k, v in models.items()}
            for p in report.points:
                memory = p.device_bytes if p.device_bytes is not None else p.run_rss_bytes
                cells = ("error: " + p.error) if p.error else f"{p.p50_ms:.1f} | {human_bytes(memory)}"
                lines.append(f"| {attention} | {mask} | {by_path[p.model]} | {p.seq_len} | {cells} |")
                print(lines[-1], flush=True)
    header = [
        f"Measured {datetime.date.today()} on {args.provider} with "
        f"`.venv/bin/python -m tools.fusion_forms {' '.join(argv or sys.argv[1:])}` "
        f"(base preset, batch 1, fp32, {args.threads} threads, median of {args.iters} runs; memory: "
        "peak RSS growth of the child process while running, device memory on CUDA; key padding "
        "pads the last 25 % of keys).",
        "",
        "| attention | mask | form | L | p50 ms | memory |",
        "|---|---|---|---|---|---|",
    ]
    if args.out:
        Path(args.out).write_text("\n".join(header + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
