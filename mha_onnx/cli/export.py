"""`export`: the PyTorch reference, or a Hugging Face folder, to ONNX."""

from __future__ import annotations

import click

from mha_onnx.cli.options import emit
from mha_onnx.quantize.config import ALGORITHMS, EMBEDDINGS
from mha_onnx.rewrite.policy import KV_CACHES


@click.command("export")
@click.option("--model", "model_dir", default=None,
              help="A Hugging Face folder (save_pretrained: config + safetensors) to export, "
                   "fuse and validate instead of the reference MHA.")
@click.option("--task", type=click.Choice(["auto", "feature-extraction", "text-generation-with-past",
                                           "image-feature-extraction",
                                           "text2text-generation-with-past"]),
              default="auto", show_default=True, help="With --model: what to export.")
@click.option("--no-fuse", is_flag=True, help="With --model: write the export as torch.export made it.")
@click.option("--preset", default=None, help="Preset name from models/ (base, big).")
@click.option("--config", "config_file", default=None, help="A TOML/JSON config file instead.")
@click.option("--attention", type=click.Choice(["self", "cross"]), default=None)
@click.option("--mask", type=click.Choice(["none", "key-padding", "causal"]), default=None)
@click.option("--weights", default=None,
              help="safetensors or torch state_dict (ours or nn.MultiheadAttention); with "
                   "--model: int4, int8 or w8a8, the weights quantized (as `mha-onnx quantize`).")
@click.option("--kv-bits", type=int, default=0, show_default=True,
              help="With --model --kv-cache shared --weights int4|int8: 8 puts the cache in "
                   "int8 too (as `mha-onnx quantize --kv-bits 8`).")
@click.option("--embeddings", type=click.Choice(EMBEDDINGS), default="float",
              show_default=True, help="With --model --weights: the token embedding table "
              "too (as `mha-onnx quantize --embeddings`).")
@click.option("--block-size", type=int, default=32, show_default=True,
              help="With --model --weights: weights per quantization block (as quantize's).")
@click.option("--algorithm", type=click.Choice(ALGORITHMS), default="rtn",
              show_default=True, help="With --model --weights: as quantize's (gptq takes "
              "--calibration).")
@click.option("--calibration", default=None, metavar="PROMPTS.json",
              help="With --algorithm gptq: text the model reads (JSON: token-id lists, or "
                   "text read with the folder's tokenizer).")
@click.option("--mixed", multiple=True, metavar="SPEC",
              help="With --model --weights: some MatMuls wider, as quantize's --mixed "
                   "(first-last, sensitive:N, auto, a name pattern; repeat).")
@click.option("--opset", type=int, default=None, help="ONNX opset (default 20; 18 with --model).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default=None)
@click.option("--keep-float32", "keep_float32", multiple=True, metavar="MODULE",
              help="With --model --dtype float16: a module kept in float32 (a PyTorch module "
                   "name, globs allowed, e.g. 'model.layers.3.mlp'; repeat), where activations "
                   "pass float16's range.")
@click.option("--kv-cache", type=click.Choice(KV_CACHES), is_flag=False,
              flag_value="appended", default=None,
              help="Export with a KV cache (past_key/past_value in, present_* out); with --model, "
                   "the fused cache's form: appended (default) or shared (one buffer, in place).")
@click.option("--cache-padding", is_flag=True,
              help="With --kv-cache: a key padding mask over past + new keys.")
@click.option("--logits", type=click.Choice(["all", "last"]), default="all", show_default=True,
              help="With --model, decoders: last computes the LM head for each row's last kept "
                   "position only (logits [batch, 1, vocab]).")
@click.option("--atol", type=float, default=None,
              help="With --model: the tolerance of fuse's verification and of the check "
                   "against PyTorch (default by dtype).")
@click.option("--rtol", type=float, default=None)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of random weights.")
@click.option("-o", "--output", required=True, help="Where to write the .onnx file.")
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def export(model_dir, task, no_fuse, preset, config_file, attention, mask, weights, kv_bits,
           embeddings, block_size, algorithm, calibration, mixed, opset, dtype, keep_float32,
           kv_cache, cache_padding, logits, atol, rtol, seed, output, force, as_json):
    """Export the PyTorch reference (or, with --model, a Hugging Face model) to ONNX with
    dynamic batch and sequence axes."""
    from mha_onnx.config import load_config_file, load_preset
    from mha_onnx.errors import ConfigError
    from mha_onnx.export.mha import export_model

    if model_dir:
        given = [n for n, v in (("--preset", preset), ("--config", config_file),
                                ("--attention", attention), ("--mask", mask),
                                ("--cache-padding", cache_padding)) if v]
        if given:
            raise ConfigError(f"--model excludes {', '.join(given)}",
                              hint="the folder's config says what the model is")
        from pathlib import Path

        from mha_onnx.cli.quantize import prompts
        from mha_onnx.export.hf import HfExportConfig, export_hf

        read = prompts(calibration, Path(model_dir), "--calibration") or []
        cfg = HfExportConfig(task=task, dtype=dtype or "float32", opset=opset or 18,
                             fuse=not no_fuse, kv_cache=kv_cache or "appended", force=force,
                             logits=logits, weights=weights or "float", atol=atol, rtol=rtol,
                             kv_bits=kv_bits, embeddings=embeddings, block_size=block_size,
                             algorithm=algorithm, mixed=tuple(mixed),
                             calibration=tuple(tuple(p) for p in read),
                             keep_float32=tuple(keep_float32))
        emit(export_hf(model_dir, output, cfg, progress=lambda line: click.echo(
            f"[export] {line}", err=True)), as_json)
        return
    if logits != "all" or keep_float32:
        raise ConfigError("--logits and --keep-float32 are for a model exported with --model")
    if kv_bits or embeddings != "float" or block_size != 32 or algorithm != "rtn" \
            or calibration or mixed:
        raise ConfigError("--kv-bits, --embeddings, --block-size, --algorithm, --calibration "
                          "and --mixed are for a model exported with --model --weights")
    if atol is not None or rtol is not None:
        raise ConfigError("--atol/--rtol are for --model (the reference export is checked at its "
                          "dtype's tolerance)")
    if preset and config_file:
        raise ConfigError("--preset and --config exclude each other")
    if kv_cache == "shared":
        raise ConfigError("the reference export writes the appended cache interface",
                          hint="`mha-onnx fuse --kv-cache shared` turns it into one buffer")
    config = load_config_file(config_file) if config_file else load_preset(preset or "base")
    changes = {k: v for k, v in (("attention", attention), ("mask", mask), ("dtype", dtype),
                                 ("kv_cache", bool(kv_cache)), ("cache_padding", cache_padding))
               if v}
    report = export_model(
        config.replace(**changes), output, weights=weights, opset=opset, force=force, seed=seed
    )
    emit(report, as_json)
