"""KV-cache decode steps of a Hugging Face decoder layer with a cache (DynamicCache, exported
as Optimum-style past/present inputs and outputs): unfused, fused with the appended
interface kept, and fused with ``--kv-cache shared``, timed in turn.

    .venv/bin/python -m tools.benchmark kv [--family qwen2] [--kv-heads 2]
        [--set head_dim=64 --set 'layer_types=["full_attention"]' ...]
        [--context 128,1024,4096,16384] [--batch 1,8] [--threads 2] [--out FILE.md]

One layer, hidden 512, 8 query heads of 64 (``--kv-heads`` K/V heads), fp32, random
weights; ``profile --decode``: one new token after ``context`` cached positions, every model
of a point timed in turn (>= --min-time s each), the shared model with its buffers bound in
place. Both fused models are verified by fuse before they are timed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx

from mha_onnx.profile import ProfileConfig, profile_models
from mha_onnx.rewrite import fuse_file
from mha_onnx.rewrite.policy import FormPolicy
from tools import suite

FORMS = ("unfused", "fused, appended", "fused, shared")


def build(folder: Path, family: str, kv_heads: int, longest: int,
          fields: dict | None = None) -> dict[str, str]:
    from tests.models import hf_cached_decoder

    model = hf_cached_decoder(family, hidden=512, heads=8, kv_heads=kv_heads,
                              max_positions=longest + 8, fields=fields)
    src = folder / "unfused.onnx"
    onnx.save(model, src)
    paths = {"unfused": str(src)}
    for form, mode in (("fused, appended", "appended"), ("fused, shared", "shared")):
        out = folder / f"{mode}.onnx"
        # refuses to write a graph that fails verification
        fuse_file(src, out, policy=FormPolicy(kv_cache=mode))
        paths[form] = str(out)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = suite.parser(__doc__)
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--context", type=suite.ints, default=(128, 1024, 4096, 16384))
    parser.add_argument("--batch", type=suite.ints, default=(1, 8))
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a config field over the family's (JSON: 64, 50.0, [\"a\"])")
    args = parser.parse_args(argv)
    fields = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    suite.quiet()
    with suite.scratch("kv") as folder:
        paths = build(folder, args.family, args.kv_heads, max(args.context), fields)
        config = ProfileConfig(batches=args.batch, seq_lens=args.context,
                               threads=(args.threads,), min_time=args.min_time, iters=None,
                               interleave=True, decode=True, op_breakdown=False,
                               memory_check=False)
        report = profile_models([paths[f] for f in FORMS], config)
    form_of = {v: k for k, v in paths.items()}
    ms = {(form_of[p.model], p.batch, p.seq_len): p.p50_ms for p in report.points}
    lines = [suite.measured(suite.command("kv", argv),
                            f"{args.threads} threads; HF {args.family} layer, hidden 512, 8 "
                            f"query heads, {args.kv_heads} K/V heads, fp32"
                            + "".join(f", {k} {v}" for k, v in fields.items())
                            + "; p50 ms per step, models timed in turn"), "",
             "| batch | context | unfused | fused, appended | fused, shared | appended / unfused "
             "| shared / unfused |", "|---|---|---|---|---|---|---|"]
    for batch in args.batch:
        for context in args.context:
            u, a, s = (ms[(f, batch, context)] for f in FORMS)
            lines.append(f"| {batch} | {context} | {u:.3f} | {a:.3f} | {s:.3f} | {a / u:.2f} | "
                         f"{s / u:.2f} |")
    suite.emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
