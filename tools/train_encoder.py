"""Train the small encoder with weights that have structure (tests/fixtures/trained/bert), as
tools/train_fixture.py trains the decoder: a BERT-like masked language model on the standard
library's docstrings (nothing downloaded; the same held-out split), a byte-level BPE
tokenizer of its own (with <pad> and <mask>), seeded; saved as a BertModel (the encoder and
a seeded pooler: what feature-extraction exports). Writes the folder and
``training.json`` (settings, loss curve, held-out masked-token accuracy and perplexity
against the uniform one).

    .venv/bin/python tools/train_encoder.py --out tests/fixtures/trained/bert [--steps 1500]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.train_fixture import (  # noqa: E402
    arguments,
    batches,
    docstrings,
    optimise,
    record,
    target_log_probs,
    tokenizer,
)

MASKED = 0.15  # BERT's share of positions predicted (80% <mask>, 10% random, 10% kept)


def masked(batch: np.ndarray, mask_id: int, vocab: int, rng: np.random.Generator):
    """(inputs, labels): MASKED of the positions chosen, labels -100 elsewhere."""
    chosen = rng.random(batch.shape) < MASKED
    labels = np.where(chosen, batch, -100)
    draw = rng.random(batch.shape)
    inputs = np.where(chosen & (draw < 0.8), mask_id, batch)
    swap = chosen & (draw >= 0.8) & (draw < 0.9)
    inputs = np.where(swap, rng.integers(4, vocab, batch.shape), inputs)
    return inputs, labels


def held_out(model, ids: np.ndarray, length: int, mask_id: int, vocab: int) -> dict:
    """Masked-token accuracy and perplexity over the held-out text (seeded masks)."""
    import torch

    rng = np.random.default_rng(1)
    chunks = np.stack([ids[s:s + length] for s in range(0, len(ids) - length, length)])
    inputs, labels = masked(chunks, mask_id, vocab, rng)
    with torch.no_grad():
        logits = model(torch.from_numpy(inputs.astype(np.int64))).logits.numpy()
    where = labels != -100
    picked, truth = logits[where], labels[where]
    return {"masked_accuracy": round(float((picked.argmax(-1) == truth).mean()), 4),
            "masked_perplexity": round(math.exp(-float(
                target_log_probs(picked, truth).mean())), 2)}


def saved_encoder(model, config, out: Path) -> None:
    """The trained encoder saved as a BertModel (what feature-extraction loads): the MLM's
    encoder weights and a pooler of its own, seeded (BertForMaskedLM has none, and one
    left for from_pretrained to initialise would differ between loads)."""
    import torch
    import transformers as tf

    torch.manual_seed(1)
    encoder = tf.BertModel(config)
    left = encoder.load_state_dict(model.bert.state_dict(), strict=False)
    assert all(k.startswith("pooler.") for k in left.missing_keys), left
    encoder.eval()
    encoder.save_pretrained(out)


def train(args: argparse.Namespace) -> dict:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    text, held = docstrings()
    fast = tokenizer(text, args.vocab, args.out, ("<s>", "</s>", "<pad>", "<mask>"),
                     bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>",
                     pad_token="<pad>", mask_token="<mask>")
    ids = np.array(fast(text)["input_ids"], np.int32)
    held_ids = np.array(fast(held)["input_ids"], np.int32)
    config = tf.BertConfig(vocab_size=len(fast), hidden_size=args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                           intermediate_size=args.hidden * 4, max_position_embeddings=args.length,
                           pad_token_id=fast.pad_token_id)
    model = tf.BertForMaskedLM(config)
    rng = np.random.default_rng(0)
    rows = batches(ids, args.length - 1, args.batch, rng)

    def loss(step: int):
        inputs, labels = masked(next(rows), fast.mask_token_id, len(fast), rng)
        return model(torch.from_numpy(inputs.astype(np.int64)),
                     labels=torch.from_numpy(labels.astype(np.int64))).loss

    started = time.perf_counter()
    curve = optimise(model, args, loss)
    model.eval()
    saved_encoder(model, config, args.out)
    return {**record(args, started, curve, (int(len(ids)), int(len(held_ids))), len(fast)),
            **held_out(model, held_ids, args.length, fast.mask_token_id, len(fast))}


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0], steps=1500, lr=1e-3)
    args.out = args.out.resolve()
    result = train(args)
    (args.out / "training.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"held-out masked accuracy {result['masked_accuracy']}, perplexity "
          f"{result['masked_perplexity']} (uniform {result['uniform_perplexity']}) in "
          f"{result['seconds']} s")


if __name__ == "__main__":
    main()
