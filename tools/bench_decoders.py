"""Decoder attention fused vs unfused vs this project's own causal export, time and memory.

    .venv/bin/python -m tools.benchmark decoders [--seq-lens 512,1024,2048,4096,8192]
        [--threads 2] [--out FILE.md]

Graphs (one layer each, d_model 512, 8 heads, batch 1, fp32, random weights):
- own causal export (mha-onnx export --mask causal), fused;
- torch.nn.MultiheadAttention with a float triu(-inf) mask (generate_square_subsequent_mask);
- a GPT-2-like and a Llama-like (8 query / 2 K/V heads) Hugging Face decoder layer built
  from configs (embeddings, norms and MLP included), fed an all-ones attention mask;
- a T5-like decoder self-attention (causal + relative position bias) on GroupQueryAttention
  with attention_bias vs MultiHeadAttention with the dense bias (--form causal=bias);
- a BLOOM layer (ALiBi added on merged heads, causal + padding mask) likewise.
``--only`` keeps the row groups whose labels start with its prefixes (e.g. ``HF bloom``).
Time: p50, all graphs of a length timed in turn in one process (>= --min-time s each).
Memory: peak RSS growth of a child process per graph while running.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import torch
from torch import nn

from mha_onnx.config import load_preset
from mha_onnx.export.mha import export_model
from mha_onnx.graph.files import write_model
from mha_onnx.profile import ProfileConfig, profile_models
from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.table import human_bytes
from tests.models import RelativeBiasCausal
from tools import suite

D, H = 512, 8


class _TorchCausal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


def _export(module: nn.Module, args: tuple, dynamic: dict, names: list[str]) -> onnx.ModelProto:
    from tests.models import export

    return export(module.eval(), args, dynamic, names=names)


def _torch_causal() -> onnx.ModelProto:
    torch.manual_seed(0)
    seq = torch.export.Dim("seq", min=1)
    return _export(_TorchCausal(), (torch.randn(1, 5, D),), {"x": {1: seq}}, ["x"])


def _hf(family: str) -> onnx.ModelProto:
    import transformers as tf

    from tests.models import HfWrap

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=1000, n_embd=D, n_layer=1, n_head=H, n_positions=8192,
                            attn_implementation="eager")
        model = tf.GPT2Model(cfg)
    elif family == "bloom":
        cfg = tf.BloomConfig(vocab_size=1000, hidden_size=D, n_layer=1, n_head=H,
                             attn_implementation="eager")
        model = tf.BloomModel(cfg)
    else:
        cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=D, num_hidden_layers=1,
                             num_attention_heads=H, num_key_value_heads=2,
                             intermediate_size=2 * D, max_position_embeddings=8192,
                             attn_implementation="eager")
        model = tf.LlamaModel(cfg)
    wrapped = HfWrap(model.eval(), ["input_ids", "attention_mask"], "last_hidden_state")
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1)
    return _export(wrapped, (torch.randint(0, 999, (2, 6)), torch.ones(2, 6, dtype=torch.int64)),
                   {"args": ({0: batch, 1: seq}, {0: batch, 1: seq})},
                   ["input_ids", "attention_mask"])


def _t5() -> onnx.ModelProto:
    torch.manual_seed(0)
    seq = torch.export.Dim("seq", min=1)
    return _export(RelativeBiasCausal(D, H, 64), (torch.randn(1, 5, D),), {"x": {1: seq}}, ["x"])


def build(folder: Path, only: tuple[str, ...] = ()) -> dict[str, str]:
    """Label -> path of every graph measured (``only``: the groups starting with these)."""
    paths: dict[str, str] = {}
    groups = [g for g in GROUPS if not only or any(p.startswith(only) for p in g)]

    def save(label: str, model: onnx.ModelProto, forms: FormPolicy | None = None,
             fuse: bool = True):
        if not any(label.startswith(prefixes) for prefixes in groups):
            return
        path = folder / f"{len(paths)}.onnx"
        write_model(fuse_model(model, forms)[0] if fuse else model, path, force=True)
        paths[label] = str(path)

    own = folder / "own.onnx"
    export_model(load_preset("base").replace(mask="causal"), own, force=True)
    save("own causal export, fused", onnx.load(own))
    torch_causal = _torch_causal()
    save("nn.MultiheadAttention float mask, unfused", torch_causal, fuse=False)
    save("nn.MultiheadAttention float mask, fused", torch_causal)
    for family in ("gpt2", "llama"):
        model = _hf(family)
        save(f"HF {family} layer, unfused", model, fuse=False)
        save(f"HF {family} layer, fused", model)
    t5 = _t5()
    save("T5-like causal + position bias, unfused", t5, fuse=False)
    save("T5-like, fused: GQA + attention_bias", t5)
    save("T5-like, fused: MHA + dense bias", t5, FormPolicy(causal="bias"))
    bloom = _hf("bloom")
    save("HF bloom layer, unfused", bloom, fuse=False)
    save("HF bloom layer, fused: GQA + attention_bias", bloom)
    save("HF bloom layer, fused: MHA + dense bias", bloom, FormPolicy(causal="bias"))
    return paths


INTERLEAVE_MAX = 4096  # beyond, each graph is timed in a child process of its own
GROUPS = (("own causal export", "nn.MultiheadAttention"), ("HF gpt2",), ("HF llama",), ("T5-like",),
          ("HF bloom",))


def _dense(label: str) -> bool:
    """Graphs that hold [B, H, S, T] scores (O(L^2) memory)."""
    return "unfused" in label or "dense" in label or "attention_bias" in label


def _fits(label: str, n: int) -> bool:
    """Skip O(L^2) graphs whose scores (a few copies) would not fit in half the free memory."""
    from mha_onnx.profile.memory import available_memory

    return not _dense(label) or 8 * H * n * n * 4 < 0.5 * available_memory()


def measure(paths: dict[str, str], seq_lens: list[int], threads: int, min_time: float) -> dict:
    """{(label, L): [ms, bytes]}: memory (and, past INTERLEAVE_MAX, time) in a child process
    per graph; time up to INTERLEAVE_MAX with the graphs of a family in turn in one process."""
    out: dict = {}
    for n in seq_lens:
        chosen = {k: v for k, v in paths.items() if _fits(k, n)}
        by_path = {v: k for k, v in chosen.items()}
        memory = ProfileConfig(seq_lens=(n,), threads=threads, iters=2, min_time=None,
                               warmup=1, op_breakdown=False, memory_check=False)
        for p in profile_models(list(chosen.values()), memory).points:
            out[(by_path[p.model], n)] = [None if p.error else p.p50_ms,
                                          None if p.error else p.memory]
        if n > INTERLEAVE_MAX:
            continue
        for prefixes in GROUPS:
            group = [v for k, v in chosen.items() if k.startswith(prefixes)]
            if not group:  # a row group left out by --only
                continue
            timing = ProfileConfig(seq_lens=(n,), threads=threads, iters=3, min_time=min_time,
                                   warmup=1, op_breakdown=False, memory_check=False,
                                   interleave=True)
            for p in profile_models(group, timing).points:
                if not p.error:
                    out[(by_path[p.model], n)][0] = p.p50_ms
    return out


def render(paths: dict[str, str], results: dict, seq_lens: list[int], command: str,
           threads: int) -> list[str]:
    lines = [suite.measured(command, f"{threads} threads, batch 1, fp32; p50 of the graphs of "
                            "one family (one row group) timed in turn in one process up to "
                            f"L={INTERLEAVE_MAX}, of a child process per graph beyond; memory: "
                            "peak RSS growth of a child process per graph; '-': not run, its "
                            "O(L^2) scores would not fit in half the free memory"), "",
             "| graph | " + " | ".join(f"L={n}" for n in seq_lens) + " |",
             "|---|" + "---|" * len(seq_lens)]
    for label in paths:
        cells = []
        for n in seq_lens:
            ms, mem = results.get((label, n), (None, None))
            cells.append("-" if ms is None else f"{ms:.1f} ms / {human_bytes(mem or 0)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    own = "own causal export, fused"
    torch_fused = "nn.MultiheadAttention float mask, fused"
    ratios = [f"L={n}: {results[(torch_fused, n)][0] / results[(own, n)][0]:.2f}x"
              for n in seq_lens if results.get((torch_fused, n), [None])[0]
              and results.get((own, n), [None])[0]]
    if ratios:
        lines += ["", "nn.MultiheadAttention (float mask) fused / own causal export fused: "
                  + ", ".join(ratios)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = suite.parser(__doc__)
    parser.add_argument("--seq-lens", type=suite.ints, default=(512, 1024, 2048, 4096, 8192))
    parser.add_argument("--only", default="", help="comma list of row-group prefixes")
    args = parser.parse_args(argv)
    suite.quiet()
    with suite.scratch("decoders") as folder:
        paths = build(folder, tuple(p for p in args.only.split(",") if p))
        results = measure(paths, list(args.seq_lens), args.threads, args.min_time)
    suite.emit(render(paths, results, list(args.seq_lens), suite.command("decoders", argv),
                      args.threads), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
