"""`quantize`: a float model's weights in 4 or 8 bits, measured against it first."""

from __future__ import annotations

from pathlib import Path

import click

from mha_onnx.cli.options import emit
from mha_onnx.quantize.config import ALGORITHMS, EMBEDDINGS, WEIGHTS


def prompts(path: str | None, folder: Path, option: str) -> list[list[int]] | None:
    """``option``'s prompts (token ids, or text through the tokenizer in ``folder``)."""
    from mha_onnx.errors import ConfigError
    from mha_onnx.generate.text import load_prompts, load_tokenizer

    if path is None:
        return None
    tokenizer = load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None
    read = [p for p in load_prompts(path, tokenizer, option) if p]
    if not read:
        raise ConfigError(f"{option} {path} holds no prompt")
    return read


@click.command("quantize")
@click.argument("model")
@click.option("-o", "--output", required=True, help="Where to write the quantized model.")
@click.option("--weights", type=click.Choice(WEIGHTS), default="int4",
              show_default=True,
              help="int4 | int8: MatMulNBits (weights only; one user at a time); w8a8: int8 "
                   "weights per column and activations per row through ORT's integer GEMM "
                   "(many rows at once: a server's batches, long prompts).")
@click.option("--embeddings", type=click.Choice(EMBEDDINGS), default="float",
              show_default=True, help="The token embedding table: float, or int4/int8 per "
              "--block-size block through ORT's GatherBlockQuantized (its tied LM head is "
              "a MatMul of its own either way).")
@click.option("--block-size", type=int, default=32, show_default=True,
              help="Weights per quantization block (a power of 2 >= 16).")
@click.option("--symmetric/--asymmetric", default=True, show_default=True,
              help="Asymmetric: a zero point per block too.")
@click.option("--accuracy-level", type=int, default=4, show_default=True,
              help="MatMulNBits' accuracy_level: 4 computes in int8 on the CPU (GenAI's "
                   "default), 0 in float.")
@click.option("--algorithm", type=click.Choice(ALGORITHMS), default="rtn",
              show_default=True, help="RTN or HQQ (ONNX Runtime's quantizer), or GPTQ (int4 "
              "whose rounding errors make up for each other on --calibration's activations).")
@click.option("--calibration", "weight_calibration", default=None, metavar="PROMPTS.json",
              help="With --algorithm gptq: text the model reads (JSON: token-id lists, or "
                   "text read with the tokenizer beside MODEL), in windows of 128 tokens.")
@click.option("--exclude", multiple=True, metavar="PATTERN",
              help="MatMul node or weight names kept float (fnmatch; repeat), e.g. "
                   "'*lm_head*'. Embeddings (Gather) always stay float.")
@click.option("--mixed", multiple=True, metavar="SPEC",
              help="Some MatMuls in int8: first-last (the first and last layers), "
                   "sensitive:N (the N the accuracy report ranks most sensitive), auto (the "
                   "fewest of those, in int8 or else float, for the thresholds to pass) or "
                   "a name pattern (repeat).")
@click.option("--kv-bits", type=int, default=0, show_default=True,
              help="8: the KV cache of a --kv-cache shared fusion in int8 too (per K/V head "
                   "and channel, scales from the float model's cache); 0: as it is.")
@click.option("--kv-calibration", "calibration", default=None, metavar="PROMPTS.json",
              help="With --kv-bits: prompts whose cache sets the scales (JSON: token-id "
                   "lists, or text read with the tokenizer beside MODEL); default: random "
                   "ids, which may leave real text's outliers clipped.")
@click.option("--eval-prompts", "eval_prompts", default=None, metavar="PROMPTS.json",
              help="The prompts a decoder's accuracy is measured on (JSON: token-id lists, or "
                   "text read with the tokenizer beside MODEL; each cut to the shortest's "
                   "length, 16-128 tokens); default: 4 random-id prompts of 64 tokens, which "
                   "read a trained model worse than its own kind of text does.")
@click.option("--max-kl", type=float, default=0.05, show_default=True,
              help="Most mean KL (nats) of the next-token distributions against the float "
                   "model.")
@click.option("--min-top1", type=float, default=0.80, show_default=True,
              help="Least share of positions whose argmax agrees.")
@click.option("--min-cosine", type=float, default=0.95, show_default=True,
              help="Least mean cosine of every output against the float model's.")
@click.option("--min-greedy", type=float, default=None,
              help="Least mean share of greedy tokens before the first difference "
                   "(default: reported only).")
@click.option("--no-sensitivity", is_flag=True,
              help="Skip ranking the weights (a run of the float model per weight).")
@click.option("--no-check", is_flag=True, help="Write the model even past the thresholds.")
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def quantize(ctx, model, output, weights, embeddings, block_size, symmetric, accuracy_level, algorithm, exclude,
             mixed, kv_bits, calibration, eval_prompts, max_kl, min_top1, min_cosine, min_greedy,
             no_sensitivity, no_check, force, as_json, weight_calibration):
    """Quantize MODEL's MatMul weights with ONNX Runtime's quantizer (in every graph of a
    fused model) and measure it against MODEL: written when the accuracy holds (exit 1
    otherwise, nothing written)."""
    from mha_onnx.errors import ConfigError
    from mha_onnx.quantize.accuracy import Thresholds
    from mha_onnx.quantize.config import parse_mixed
    from mha_onnx.quantize.run import quantize_file
    from mha_onnx.quantize.weights import QuantizeConfig

    folder = Path(model).resolve().parent  # (the tokenizer beside MODEL reads text prompts)
    if weight_calibration and algorithm != "gptq":
        raise ConfigError("--calibration feeds GPTQ's activations", hint="--algorithm gptq")
    if calibration and not kv_bits:
        raise ConfigError("--kv-calibration sets an int8 cache's scales", hint="--kv-bits 8")
    int8, first_last, sensitive = parse_mixed(mixed)
    config = QuantizeConfig(weights=weights, block_size=block_size, symmetric=symmetric,
                            accuracy_level=accuracy_level, algorithm=algorithm,
                            exclude=tuple(exclude), int8=int8, first_last=first_last,
                            kv_bits=kv_bits, embeddings=embeddings)
    thresholds = Thresholds(max_kl, min_top1, min_cosine, min_greedy)
    if sensitive == "auto" and no_check:
        raise ConfigError("--mixed auto searches for what passes the thresholds",
                          hint="leave out --no-check")
    report = quantize_file(model, output, config, thresholds, sensitivity=not no_sensitivity,
                           int8_most_sensitive=0 if sensitive == "auto" else sensitive,
                           mixed_auto=sensitive == "auto", check=not no_check, force=force,
                           progress=(lambda _: None) if as_json else (
                               lambda line: click.echo(f"[quantize] {line}", err=True)),
                           calibration=prompts(calibration, folder, "--kv-calibration"),
                           prompts=prompts(eval_prompts, folder, "--eval-prompts"),
                           weight_calibration=prompts(weight_calibration, folder,
                                                      "--calibration"))
    emit(report, as_json)
    ctx.exit(0 if report.written and (no_check or report) else 1)
