"""`fuse --tune` against the untuned fusion and the original, on this machine.

    .venv/bin/python -m tools.benchmark tune OUT_DIR [--threads 2] [--batches 1,8,32]
        [--seq-lens 16,32,64,128,512,2048] [--models causal,key-padding,none,bert[,bert-base]]

For each model (the base preset's causal, key-padding and no-mask exports, and a BERT-style
Hugging Face encoder with a padding mask): tune it over the grid, then time the original,
the default fusion and the tuned model interleaved in one process (`mha-onnx profile`,
25 % of keys padded) and print each point's ratios to the original. ``bert`` is a tiny
encoder (tests/models.py, torch.export); ``bert-base`` (not in the default list) is a BERT
of base width (hidden 768, 12 heads, 4 layers, random weights) exported by the TorchScript
exporter with Optimum's input names and dims, as the files users have are made.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tools import suite


def _models(folder: Path, names: list[str]) -> dict[str, Path]:
    import onnx

    from mha_onnx.config import load_preset
    from mha_onnx.export import export_model

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


def main(argv: list[str] | None = None) -> int:
    from mha_onnx.profile import ProfileConfig, profile_models
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.tune import TuneConfig
    from mha_onnx.tune_run import tune_model

    parser = suite.parser(__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--batches", type=suite.ints, default=(1, 8, 32))
    parser.add_argument("--seq-lens", type=suite.ints, default=(16, 32, 64, 128, 512, 2048))
    parser.add_argument("--models", default="causal,key-padding,none,bert")
    args = parser.parse_args(argv)
    suite.quiet()
    args.folder.mkdir(parents=True, exist_ok=True)
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
