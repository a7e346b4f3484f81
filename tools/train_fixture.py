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


def tokenizer(text: str, vocab: int, out: Path, special: tuple[str, ...] = ("<s>", "</s>"),
              **roles: str):
    """A byte-level BPE of ``vocab`` tokens trained on ``text`` (``special`` tokens first),
    saved in ``out``; ``roles``: the transformers tokenizer's special tokens (bos/eos by
    default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(special), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe,
                                   **(roles or {"bos_token": "<s>", "eos_token": "</s>"}))
    fast.save_pretrained(out)
    return fast


def target_log_probs(logits, targets) -> np.ndarray:
    """log softmax(``logits``) at each row's ``targets`` (float64; logits [..., vocab],
    targets [...]): what every held-out perplexity here is the mean of."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]


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


def optimise(model, args: argparse.Namespace, loss) -> list[tuple[int, float]]:
    """``args.steps`` AdamW steps (one-cycle schedule to ``args.lr``, gradients clipped at
    1) of ``loss(step)``; the loss every 100 steps, said on stderr as it goes."""
    import torch

    optimiser = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, args.lr, total_steps=args.steps,
                                                   pct_start=0.05)
    curve, started = [], time.perf_counter()
    for step in range(args.steps):
        value = loss(step)
        optimiser.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            curve.append((step, round(value.item(), 4)))
            print(f"step {step}: loss {value.item():.3f} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return curve


def record(args: argparse.Namespace, started: float, curve, tokens: tuple[int, int],
           vocab: int) -> dict:
    """training.json's fields every trained fixture has."""
    import torch

    return {"command": " ".join(sys.argv), "python": sys.version.split()[0],
            "torch": torch.__version__, "tokens": {"train": tokens[0], "held_out": tokens[1]},
            "seconds": round(time.perf_counter() - started, 1), "loss": curve,
            "uniform_perplexity": vocab,
            "settings": {k: v for k, v in vars(args).items() if k != "out"}}


def arguments(description: str, steps: int, lr: float) -> argparse.Namespace:
    """The trainers' command line (--out, sizes, steps, learning rate, threads), --out made."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


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
    rng = np.random.default_rng(0)
    chunks = batches(ids, args.length, args.batch, rng)

    def loss(step: int):
        chunk = torch.from_numpy(next(chunks).astype(np.int64))
        return model(chunk[:, :-1], labels=chunk[:, :-1]).loss

    started = time.perf_counter()
    curve = optimise(model, args, loss)
    model.eval()
    model.save_pretrained(args.out)
    model.generation_config.save_pretrained(args.out)
    return {**record(args, started, curve, (int(len(ids)), int(len(held_ids))), len(fast)),
            "held_out_perplexity": round(perplexity(model, held_ids, args.length), 2)}


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0], steps=1200, lr=3e-3)
    result = train(args)
    (args.out / "training.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"held-out perplexity {result['held_out_perplexity']} (uniform "
          f"{result['uniform_perplexity']}) in {result['seconds']} s")


if __name__ == "__main__":
    main()
