"""Prompt and decode of an Optimum Llama export: as exported, fused by mha-onnx, by ORT's
transformers optimizer, and ORT GenAI's hand-built graph for the same weights.

Three environments (each tool's own pins; `make bench-envs` makes the two extra ones), one
folder:

    .venv-optimum/bin/python -m tools.bench_optimum make DIR [--layers N] [--vocab V]
    .venv-genai/bin/python -m tools.bench_optimum genai DIR [--precision int4]  # GenAI's builder
    .venv/bin/python -m tools.benchmark optimum run DIR [--threads 2] [--prompt 1024]
        [--context 4096] [--batch 1] [--left-pad 0.5] [--min-time 1] [--op-shares]
        [--reuse] [--reverse] [--out FILE.md]

The model: Llama, hidden 1024, 16 query / 4 K/V heads (head 64), 2 layers (``make --layers
N``: more), fp32, random weights (seed 0), a vocabulary of 512 (a BPE trained on a few
sentences: GenAI's builder needs a tokenizer) so that the layers, not the LM head, are
timed. ``run`` fuses the export (appended cache, and ``--kv-cache shared``), exports the HF
folder with ``mha-onnx export --model`` (both cache forms; transformers 5, no Optimum),
applies ORT's optimizer (model_type gpt2, the one its Llama path uses; opt_level 1), checks
every graph's outputs against the export's, then times each graph in turn in one process
(sleeping thread pools, ``--threads``):

- prompt: ``--prompt`` tokens, empty cache;
- decode: one token after ``--context`` cached positions (GenAI's graph and the shared form
  with their cache buffers bound as past and present, the others with an appended cache);
- the export and GenAI's graph a second time each, in sessions of their own: the noise
  floor of the run (two sessions of one graph have read up to 8 % apart here);
- ``--reverse``: the sessions and their buffers made in the reverse order of the table (two
  different graphs have read several per cent apart by that order alone: docs/history/bench-notebook.md);
- ``--left-pad F``: row b's first F*b/batch positions padded (attention_mask 0, position_ids
  counted over kept positions; GenAI's and the shared buffers hold each row's kept keys
  first, its per-row lengths), logits compared where the mask keeps.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tools import suite

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, MAX_POS = 1024, 16, 4, 2, 512, 8192


def make(folder: Path, layers: int = LAYERS, vocab: int = VOCAB) -> None:
    """HF folder (config, weights, tokenizer) and Optimum's export of it (.venv-optimum);
    ``vocab``: the model's vocabulary (its tokenizer keeps 512 tokens whatever it is)."""
    import torch
    import transformers as tf
    from optimum.exporters.onnx import main_export
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = folder / "hf"
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2816,
                            num_hidden_layers=layers, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                            bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).eval().save_pretrained(hf)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    text = ["multi-head attention from PyTorch to production under ONNX Runtime"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=VOCAB,
                                                      special_tokens=["<unk>", "<s>", "</s>"]))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                      bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(hf)
    main_export(str(hf), output=str(folder / "optimum"), task="text-generation-with-past",
                do_validation=False)


def genai(folder: Path, precision: str = "fp32") -> None:
    """ORT GenAI's builder on the same folder (.venv-genai): fp32 into genai/, int4 (its CPU
    default: block 32, symmetric, accuracy level 4) into genai-int4/."""
    import subprocess

    out = folder / ("genai" if precision == "fp32" else f"genai-{precision}")
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                    str(folder / "hf"), "-o", str(out), "-p", precision, "-e", "cpu"],
                   check=True)


def main(argv: list[str] | None = None) -> int:
    parser = suite.parser(__doc__)
    parser.add_argument("action", choices=("make", "genai", "run"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=LAYERS,
                        help="make: decoder layers (run reads them from the export)")
    parser.add_argument("--precision", choices=("fp32", "int4"), default="fp32",
                        help="genai: the builder's precision (int4 into DIR/genai-int4)")
    parser.add_argument("--vocab", type=int, default=VOCAB,
                        help="make: the model's vocabulary (a real one: 32000-150000)")
    parser.add_argument("--left-pad", type=float, default=0.0,
                        help="row b's first left_pad*b/batch of positions padded (0: none)")
    parser.add_argument("--reuse", action="store_true",
                        help="time the fused/exported graphs an earlier run wrote (default: "
                             "made anew)")
    parser.add_argument("--reverse", action="store_true",
                        help="make the sessions (and their buffers) in the reverse order: "
                             "the order alone has moved a graph's time by several %% here")
    parser.add_argument("--op-shares", action="store_true",
                        help="instead of timing: kernels per call and kernel-time shares "
                             "by op type, prompt and decode step")
    args = parser.parse_args(argv)
    if args.action == "make":
        make(args.folder, args.layers, args.vocab)
    elif args.action == "genai":
        genai(args.folder, args.precision)
    else:
        from tools.bench_optimum_run import run

        run(args, suite.command("optimum", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
