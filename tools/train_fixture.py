"""Train the small decoder with weights that have structure (tests/fixtures/trained/llama):
every accuracy figure of `quantize` on a random-weight model is near chance (its logits are
nearly flat), so the gate was never shown to tell a good quantization from a bad one.

Text: the docstrings of Python's own standard library (``ast`` over its ``.py`` files,
sorted; nothing downloaded), the last files held out. A byte-level BPE tokenizer trained
with ``tokenizers``, then a Llama-like decoder (tied embeddings, grouped K/V) with AdamW,
seeded; on one machine the same run gives the same weights. Writes the folder
(config, safetensors, tokenizer, generation config) and ``training.json`` (the command's
settings, the loss curve, held-out perplexity against the uniform one).

    .venv/bin/python tools/train_fixture.py --out tests/fixtures/trained/llama [--steps 1200]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

HELD_OUT = 0.05  # the last files' share of the text


def docstrings() -> tuple[str, str]:
    """(training text, held-out text): every docstring of the standard library's modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts
                   and "site-packages" not in p.parts)
    texts = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    texts.append(doc.strip())
    cut = int(len(texts) * (1 - HELD_OUT))
    return "\n\n".join(texts[:cut]), "\n\n".join(texts[cut:])


def tokenizer(text: str, vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return fast


def batches(ids: np.ndarray, length: int, size: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(ids) - length - 1, size)
        yield np.stack([ids[s:s + length + 1] for s in starts])


def perplexity(model, ids: np.ndarray, length: int) -> float:
    import torch

    losses = []
    with torch.no_grad():
        for start in range(0, len(ids) - length - 1, length):
            chunk = torch.from_numpy(ids[start:start + length + 1][None].astype(np.int64))
            losses.append(float(model(chunk[:, :-1], labels=chunk[:, :-1]).loss))
    return math.exp(sum(losses) / len(losses))


def train(args: argparse.Namespace) -> dict:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    text, held = docstrings()
    fast = tokenizer(text, args.vocab, args.out)
    ids = np.array(fast(text)["input_ids"], np.int32)
    held_ids = np.array(fast(held)["input_ids"], np.int32)
    config = tf.LlamaConfig(
        vocab_size=len(fast), hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
        num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=args.length * 2,
        tie_word_embeddings=True, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    model = tf.LlamaForCausalLM(config)
    optimiser = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, args.lr, total_steps=args.steps,
                                                   pct_start=0.05)
    curve, started = [], time.perf_counter()
    rng = np.random.default_rng(0)
    for step, batch in zip(range(args.steps), batches(ids, args.length, args.batch, rng),
                           strict=False):
        chunk = torch.from_numpy(batch.astype(np.int64))
        loss = model(chunk[:, :-1], labels=chunk[:, :-1]).loss
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            curve.append((step, round(loss.item(), 4)))
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr)
    model.eval()
    model.save_pretrained(args.out)
    model.generation_config.save_pretrained(args.out)
    return {"command": " ".join(sys.argv), "python": sys.version.split()[0],
            "torch": torch.__version__, "tokens": {"train": int(len(ids)),
                                                   "held_out": int(len(held_ids))},
            "seconds": round(time.perf_counter() - started, 1), "loss": curve,
            "held_out_perplexity": round(perplexity(model, held_ids, args.length), 2),
            "uniform_perplexity": len(fast),
            "settings": {k: v for k, v in vars(args).items() if k != "out"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = train(args)
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"held-out perplexity {record['held_out_perplexity']} (uniform "
          f"{record['uniform_perplexity']}) in {record['seconds']} s")


if __name__ == "__main__":
    main()
