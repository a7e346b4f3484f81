"""`fuse --tune` against the untuned fusion and the original, on this machine.

    .venv/bin/python -m tools.benchmark tune OUT_DIR [--threads 2] [--batches 1,8,32]
        [--seq-lens 16,32,64,128,512,2048] [--models causal,key-padding,none,bert[,bert-base]]
    .venv/bin/python -m tools.benchmark tune OUT_DIR --anchor [--points 1x16,1x128,...]
        [--repeat 2]

For each model (the base preset's causal, key-padding and no-mask exports, and a BERT-style
Hugging Face encoder with a padding mask): tune it over the grid, then time the original,
the default fusion and the tuned model interleaved in one process (`mha-onnx profile`,
25 % of keys padded) and print each point's ratios to the original. ``bert`` is a tiny
encoder (tests/models.py, torch.export); ``bert-base`` (not in the default list) is a BERT
of base width (hidden 768, 12 heads, 4 layers, random weights) exported by the TorchScript
exporter with Optimum's input names and dims, as the files users have are made.

``--anchor``: the BERT-base export tuned as a user tunes it (`mha-onnx fuse --tune`, every
option at its default, in a process of its own: its wall time and the output's size), then
the export, the default fusion, the tuned model and ORT's transformers optimizer's file
(`optimize_model(model_type="bert")`) timed in turn in one process at each of ``--points``,
``--repeat`` times over.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tools import suite


def _models(folder: Path, names: list[str]) -> dict[str, Path]:
    import onnx

    from mha_onnx.config import load_preset
    from mha_onnx.export.mha import export_model

    out = {}
    for name in names:
        path = folder / f"{name}.onnx"
        if not path.exists():
            if name == "bert":
                from tests.models import hf

                onnx.save(hf("bert", "eager"), path)
            elif name == "bert-base":
                _bert_base(path)
            else:
                export_model(load_preset("base").replace(mask=name), path, force=True)
        out[name] = path
    return out


def _bert_base(path: Path) -> None:
    """A BERT of base width, random weights (seed 0), through torch.onnx.export's TorchScript
    exporter (dynamo=False, opset 18), inputs as Optimum names them."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(hidden_size=768, num_attention_heads=12, num_hidden_layers=4,
                           intermediate_size=3072, max_position_embeddings=512,
                           attn_implementation="eager")
    bert = tf.BertModel(config).eval()

    class Encoder(torch.nn.Module):  # (keyword arguments: the tracer's positional ones
        def __init__(self):          # collide with transformers 5's forward)
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    model = Encoder().eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    dims = {0: "batch_size", 1: "sequence_length"}
    with torch.no_grad():
        torch.onnx.export(model, (ids, mask), str(path), dynamo=False, opset_version=18,
                          input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"],
                          dynamic_axes={"input_ids": dims, "attention_mask": dims,
                                        "last_hidden_state": dims})


def anchor(folder: Path, args, argv: list[str] | None) -> int:
    """The export, the default fusion, `fuse --tune`'s output and ORT's optimizer's, at
    each point (see the module docstring)."""
    import json
    import subprocess
    import time

    from mha_onnx.profile import ProfileConfig, profile_models
    from mha_onnx.rewrite import fuse_file

    path = _models(folder, ["bert-base"])["bert-base"]
    fused, tuned = path.with_suffix(".fused.onnx"), path.with_suffix(".tuned.onnx")
    ort = path.with_suffix(".ortopt.onnx")
    fuse_file(path, fused, force=True)
    _ort_optimized(path, ort)
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", "from mha_onnx.cli import run; run()", "fuse",
                          str(path), "-o", str(tuned), "--tune", "--force", "--json"],
                         capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - began
    report = json.loads(run.stdout[run.stdout.index("{"):])
    sizes = {m: m.stat().st_size / path.stat().st_size for m in (fused, tuned, ort)}
    lines = [suite.measured(suite.command("tune", argv),
                            f"{args.threads} threads, fp32, the four timed in turn in one "
                            "process at each point, 25 % of keys padded"), "",
             f"`mha-onnx fuse bert-base.onnx -o bert-base.tuned.onnx --tune`: {seconds:.0f} s "
             f"wall, rules `{report['rules']}`; sizes (of the export's "
             f"{path.stat().st_size / 1e6:.0f} MB): default fusion {sizes[fused]:.2f}x, tuned "
             f"{sizes[tuned]:.2f}x, ORT's optimizer {sizes[ort]:.2f}x", "",
             *[f"- {note}" for note in report["notes"]], "",
             "| run | batch | L | export ms | default fusion | tuned | ORT optimizer |",
             "|---|---|---|---|---|---|---|"]
    rows = []
    for rep in range(1, args.repeat + 1):
        for b, n in args.points:
            prof = profile_models([path, fused, tuned, ort], ProfileConfig(
                batches=(b,), seq_lens=(n,), threads=(args.threads,), interleave=True,
                pad_fraction=0.25, memory_check=False, op_breakdown=False,
                min_time=args.min_time, keep_going=True))
            ms = {p.model: p.p50_ms for p in prof.points}
            base = ms.get(str(path))
            rows.append({"run": rep, "batch": b, "length": n, "export_ms": base,
                         **{k: (ms.get(str(m)) or float("nan")) / base
                            for k, m in (("fused", fused), ("tuned", tuned), ("ort", ort))}})
            lines.append(f"| {rep} | {b} | {n} | {base:.3g} | {rows[-1]['fused']:.2f}x | "
                         f"{rows[-1]['tuned']:.2f}x | {rows[-1]['ort']:.2f}x |")
            print(lines[-1], flush=True)
    suite.emit(lines, args.out, str(folder / "bench_tune_anchor.json"),
               {"tune_s": seconds, "sizes": {str(k): v for k, v in sizes.items()},
                "report": report, "rows": rows})
    return 0


def _ort_optimized(path: Path, out: Path) -> None:
    """ORT's transformers optimizer as its docs call it for BERT (12 heads, hidden 768)."""
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(str(path), model_type="bert", num_heads=12,
                   hidden_size=768).save_model_to_file(str(out))


def _points(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.split("x")) for p in text.split(",") if p]


def main(argv: list[str] | None = None) -> int:
    from mha_onnx.profile import ProfileConfig, profile_models
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.tune.rules import TuneConfig
    from mha_onnx.tune.run import tune_model

    parser = suite.parser(__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--batches", type=suite.ints, default=(1, 8, 32))
    parser.add_argument("--seq-lens", type=suite.ints, default=(16, 32, 64, 128, 512, 2048))
    parser.add_argument("--models", default="causal,key-padding,none,bert")
    parser.add_argument("--anchor", action="store_true",
                        help="BERT-base: fuse --tune as users run it, beside ORT's optimizer")
    parser.add_argument("--points", type=_points,
                        default=_points("1x16,1x128,8x128,32x64,1x512,8x512"))
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    suite.quiet()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.anchor:
        return anchor(args.folder, args, argv)
    batches, lengths = args.batches, args.seq_lens
    rows = []
    lines = [suite.measured(suite.command("tune", argv),
                            f"{args.threads} threads, fp32, original / default fusion / tuned "
                            "timed in turn in one process, 25 % of keys padded"), "",
             "| model | batch | L | original ms | fused / original | tuned / original |",
             "|---|---|---|---|---|---|"]
    for name, path in _models(args.folder, args.models.split(",")).items():
        fused, tuned = path.with_suffix(".fused.onnx"), path.with_suffix(".tuned.onnx")
        fuse_file(path, fused, force=True)
        report = tune_model(path, tuned, TuneConfig(batches=batches, seq_lens=lengths,
                                                    threads=args.threads), force=True,
                            progress=lambda line: print("  [tune]", line, file=sys.stderr))
        print(f"{name}: tuned in {report.seconds:.0f} s: {report.result.describe()}", flush=True)
        prof = profile_models([path, fused, tuned], ProfileConfig(
            batches=batches, seq_lens=lengths, threads=(args.threads,), interleave=True,
            pad_fraction=0.25, memory_check=False, op_breakdown=False, min_time=args.min_time,
            keep_going=True))
        times = {(p.model, p.batch, p.seq_len): p.p50_ms for p in prof.points}
        for b in batches:
            for n in lengths:
                base = times.get((str(path), b, n))
                if not base or not all(times.get((str(m), b, n)) for m in (fused, tuned)):
                    continue  # a point the model cannot run (BERT past its position table)
                rows.append({"model": name, "batch": b, "length": n, "original_ms": base,
                             "fused": times[(str(fused), b, n)] / base,
                             "tuned": times[(str(tuned), b, n)] / base,
                             "rules": report.result.describe()})
                lines.append(f"| {name} | {b} | {n} | {base:.3g} | {rows[-1]['fused']:.2f}x | "
                             f"{rows[-1]['tuned']:.2f}x |")
                print(lines[-1], flush=True)
    suite.emit(lines, args.out, str(args.folder / "bench_tune.json"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
