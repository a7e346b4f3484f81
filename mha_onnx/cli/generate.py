"""The CLI of generation: `mha-onnx generate` (see mha_onnx.generate)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import click


def _progress():
    """A progress line on stderr, at most once a second, for runs longer than a second."""
    state = {"start": time.perf_counter(), "shown": 0.0}

    def step(done: int, total: int) -> None:
        now = time.perf_counter() - state["start"]
        if now - state["shown"] >= 1.0 or (done == total and state["shown"]):
            state["shown"] = now
            click.echo(f"\r[generate] step {done}/{total}, {now:.1f} s", err=True,
                       nl=done == total)

    return step


@click.command("generate")
@click.argument("model")
@click.option("--prompts", "prompts_path", required=True,
              help="JSON: a list of token-id lists (ragged), or of strings with --tokenizer.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--sample", is_flag=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0: no top-k.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1: no top-p.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eos", "eos", multiple=True, type=int,
              help="End-of-sequence token id (repeat; default: the model's own).")
@click.option("--max-length", type=int, default=None,
              help="Positions of a shared cache's buffers (default: the longest prompt plus "
                   "--max-new-tokens).")
@click.option("--tokenizer", "tokenizer_dir", default=None,
              help="A HF folder with tokenizer files: prompts as text, output as text.")
@click.option("--threads", type=int, default=None, help="Intra-op threads for ORT.")
@click.option("--prompt-as-written", is_flag=True,
              help="Every run of a quantized model through the file as written, one "
                   "session (by default: long prompts in float compute on a CPU without "
                   "VNNI, faster there from 64 tokens; a shared-cache fusion's steps "
                   "through its fast form alone, its Ifs taken apart).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def generate_command(model, prompts_path, max_new_tokens, sample, temperature, top_k, top_p,
                     seed, eos, max_length, tokenizer_dir, threads, prompt_as_written, as_json):
    """Generate tokens with a decoder (exported or fused, either cache form) on ONNX
    Runtime: the prompts left-padded into one batch, one token per step, IO binding."""
    from mha_onnx.generate import GenerationConfig, Generator, Sampling
    from mha_onnx.generate.text import decode, load_prompts, load_tokenizer

    config = GenerationConfig(max_new_tokens=max_new_tokens,
                              sampling=Sampling(sample, temperature, top_k, top_p, seed),
                              eos=tuple(eos) or None, max_length=max_length)
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    prompts = load_prompts(prompts_path, tokenizer)
    floated = False if prompt_as_written else None  # (None: by the CPU, prompt.py)
    with Generator(model, threads=threads, float_prompt=floated) as generator:
        if tokenizer is not None and config.eos is None and not generator.interface.tokens.eos \
                and tokenizer.eos_token_id is not None:  # the model's own, else the tokenizer's
            config = replace(config, eos=(int(tokenizer.eos_token_id),))
        generator.check(prompts, config)  # bad input: refused before any run
        result = generator.generate(prompts, config,
                                    on_step=None if as_json or not sys.stderr.isatty()
                                    else _progress())
    if tokenizer is not None:
        result = replace(result, texts=decode(tokenizer, result.sequences))
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.render())
