"""Measure every fused form ORT offers for each attention variant, to choose the defaults
(and the lengths at which an automatic form switches).

    .venv/bin/python -m tools.benchmark forms [--batches 1] [--seq-lens 512,2048,8192]
        [--variants self-none,cross-none,self-key-padding,cross-key-padding,self-causal]
        [--interleave] [--threads 2] [--provider cpu] [--dtype float32] [--out FILE.md]
        [--json FILE.json]

For each variant it exports the base preset, fuses it with each form (plus the unfused export
and the ONNX Attention op), and profiles them side by side per batch x length: p50 latency
and, without --interleave, peak working memory (RSS growth of a child process while running;
device memory on CUDA). --interleave times all forms of a point in turn in one process (fair
ratios on a shared machine; no memory). Key padding pads the last 25 % of keys.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx

from mha_onnx.config import load_preset
from mha_onnx.export.mha import export_model
from mha_onnx.graph.files import write_model
from mha_onnx.profile import ProfileConfig, profile_models
from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.table import human_bytes
from tools import suite

VARIANTS = {
    "self-none": [("MultiHeadAttention", FormPolicy())],
    "cross-none": [("MultiHeadAttention", FormPolicy())],
    "self-key-padding": [("auto (default)", FormPolicy()),
                         ("GQA bidirectional (right padding) | Loop",
                          FormPolicy(key_padding="gqa")),
                         ("Loop(Compress) + MHA", FormPolicy(key_padding="loop")),
                         ("MHA key_padding_mask", FormPolicy(key_padding="mask")),
                         ("MHA dense bias", FormPolicy(key_padding="bias"))],
    "cross-key-padding": [("auto (default)", FormPolicy()),
                          ("Loop(Compress) + MHA", FormPolicy(key_padding="loop")),
                          ("MHA key_padding_mask", FormPolicy(key_padding="mask")),
                          ("MHA dense bias", FormPolicy(key_padding="bias"))],
    "self-causal": [("GroupQueryAttention", FormPolicy(causal="gqa")),
                    ("MHA unidirectional", FormPolicy(causal="unidirectional")),
                    ("MHA causal bias", FormPolicy(causal="bias"))],
}


def _models(variant: str, folder: Path, dtype: str = "float32") -> dict[str, str]:
    attention, mask = variant.split("-", 1)
    cfg = load_preset("base").replace(attention=attention, mask=mask, dtype=dtype)
    base = folder / f"{variant}-{dtype}.onnx"
    export_model(cfg, base, force=True)
    original = onnx.load(base)
    models = {"unfused export": str(base)}
    for n, (label, policy) in enumerate(VARIANTS[variant]):
        path = folder / f"{variant}-{dtype}-{n}.onnx"
        write_model(fuse_model(original, policy)[0], path, force=True)
        models[label] = str(path)
    path = folder / f"{variant}-{dtype}-onnx.onnx"
    write_model(fuse_model(original, FormPolicy(target="onnx"))[0], path, force=True)
    models["ONNX Attention (opset 23)"] = str(path)
    return models


def main(argv: list[str] | None = None) -> int:
    parser = suite.parser(__doc__, min_time=None, json_out=True)
    parser.add_argument("--batches", type=suite.ints, default=(1,))
    parser.add_argument("--seq-lens", type=suite.ints, default=(512, 2048, 8192))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--interleave", action="store_true")
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    args = parser.parse_args(argv)
    suite.quiet()
    lines, records = [], []
    with suite.scratch("forms") as folder:
        for variant in args.variants.split(","):
            models = _models(variant, folder, args.dtype)
            config = ProfileConfig(providers=(args.provider,), batches=args.batches,
                                   seq_lens=args.seq_lens, iters=args.iters,
                                   min_time=args.min_time, warmup=1, threads=args.threads,
                                   op_breakdown=False, memory_check=False,
                                   interleave=args.interleave,
                                   io_binding=args.provider != "cpu",
                                   pad_fraction=0.25 if "key-padding" in variant else 0.0)
            report = profile_models(list(models.values()), config)
            by_path = {v: k for k, v in models.items()}
            base = {(p.batch, p.seq_len): p.p50_ms for p in report.points
                    if by_path[p.model] == "unfused export" and not p.error}
            for p in report.points:
                ratio = p.p50_ms / base[(p.batch, p.seq_len)] if (p.batch, p.seq_len) in base \
                    and not p.error else None
                memory = "-" if p.memory is None else human_bytes(p.memory)
                cells = (f"error: {p.error}" if p.error else
                         f"{p.p50_ms:.2f} | {'-' if ratio is None else f'{ratio:.2f}'} | {memory}")
                lines.append(f"| {variant} | {by_path[p.model]} | {p.batch} | {p.seq_len} | {cells} |")
                records.append({"variant": variant, "form": by_path[p.model], "dtype": args.dtype,
                                "provider": args.provider, "batch": p.batch, "seq_len": p.seq_len,
                                "p50_ms": None if p.error else p.p50_ms, "ratio": ratio,
                                "memory": p.memory, "error": p.error})
                print(lines[-1], flush=True)
    timing = ("all forms of a point timed in turn in one process" if args.interleave
              else "each point in a child process of its own")
    header = [
        suite.measured(suite.command("forms", argv),
                       f"{args.provider}, base preset, {args.dtype}, {args.threads} threads, "
                       f"median of >= {args.iters} runs, {timing}; memory: peak RSS growth of "
                       "the child process while running, device memory on CUDA; key padding "
                       "pads the last 25 % of keys; ratio: p50 over the unfused export's"),
        "",
        "| variant | form | batch | L | p50 ms | / unfused | memory |",
        "|---|---|---|---|---|---|---|",
    ]
    suite.emit(header + lines, args.out, args.json_path, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
