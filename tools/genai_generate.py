"""Tokens from ONNX Runtime GenAI's own generator on a model folder (genai_config.json), for
tests and benchmarks. Runs in GenAI's environment (`make genai-env`: .venv-genai-rt, whose
onnxruntime is GenAI's 1.32), so it imports nothing of mha_onnx:

    .venv-genai-rt/bin/python tools/genai_generate.py FOLDER --prompts P.json \
        [--max-new-tokens 32] [--mode batch|each] [--repeat N] [--threads N]

``--mode batch``: every prompt in one batch, right-padded with the config's pad_token_id
(as GenAI expects a batch); ``each``: one generator per prompt. Prints one JSON object:
the new tokens of each row (up to an EOS, which is left out: GenAI
returns it for some rows only), the seconds of each repeat, the
time to the first token and the decode time per token of the fastest repeat.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def load(folder: str, threads: int | None):
    """GenAI's model of ``folder`` (its session made once for every run)."""
    import onnxruntime_genai as og

    config = og.Config(folder)
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    return og.Model(config)


def run(model, folder: str, prompts: list[list[int]], new: int, no_eos: bool = False):
    import numpy as np
    import onnxruntime_genai as og

    settings = json.loads((Path(folder) / "genai_config.json").read_text())["model"]
    pad = settings["pad_token_id"]
    eos = settings["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    longest = max(len(p) for p in prompts)
    ids = np.full((len(prompts), longest), pad, np.int32)
    for b, prompt in enumerate(prompts):
        ids[b, :len(prompt)] = prompt
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=longest + new, batch_size=len(prompts),
                              do_sample=False, **({"min_length": longest + new} if no_eos
                                                  else {}))
    generator = og.Generator(model, params)
    started = time.perf_counter()
    generator.append_tokens(ids)  # the prompt run
    generator.generate_next_token()  # the first token (from the prompt's logits)
    first = time.perf_counter()
    steps = 1
    while not generator.is_done() and steps < new:
        generator.generate_next_token()  # one run with the last token, then the next token
        steps += 1
    done = time.perf_counter()
    rows = []
    for b in range(len(prompts)):
        sequence = [int(t) for t in generator.get_sequence(b)][longest:]
        cut = next((i for i, t in enumerate(sequence) if t in eos), None)
        rows.append(sequence[:cut] if cut is not None else sequence[:new])  # EOS left out
    return rows, first - started, done - first, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--mode", choices=["batch", "each"], default="batch")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-eos", action="store_true",
                        help="run every row --max-new-tokens (min_length = max_length)")
    args = parser.parse_args(argv)
    prompts = json.loads(Path(args.prompts).read_text())
    batches = [prompts] if args.mode == "batch" else [[p] for p in prompts]
    best, seconds, sequences = None, [], []
    model = load(args.folder, args.threads)
    for _ in range(args.repeat):
        sequences, total = [], 0.0
        for batch in batches:
            rows, prompt_s, decode_s, steps = run(model, args.folder, batch,
                                                  args.max_new_tokens, args.no_eos)
            sequences += rows
            total += prompt_s + decode_s
            if best is None or prompt_s + decode_s < best[0] + best[1]:
                best = (prompt_s, decode_s, steps, len(batch))
        seconds.append(total)
    prompt_s, decode_s, steps, batch = best
    print(json.dumps({"sequences": sequences, "seconds": seconds,
                      "time_to_first_token_ms": 1e3 * prompt_s,
                      "ms_per_step": 1e3 * decode_s / max(1, steps - 1),
                      "decode_tokens_per_s": batch * (steps - 1) / decode_s if decode_s else 0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
