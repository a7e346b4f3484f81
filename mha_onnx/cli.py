"""The mha-onnx command line: parse options, build a config, call one library function,
print its report. Heavy imports happen inside commands so ``--help`` stays instant."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from typing import Any

import click

from mha_onnx import __version__
from mha_onnx.cli_options import int_list, progress_bar, thread_counts
from mha_onnx.cli_tune import run_tune, tune_command, tune_options
from mha_onnx.config import EP_CHOICES, form_help
from mha_onnx.errors import EXIT_MISMATCH, MhaOnnxError


class _Group(click.Group):
    """Catches the package's errors and click's usage errors once: one line with a hint, an
    exit code, no traceback (``-v`` prints the traceback too)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        self.as_json = "--json" in (sys.argv[1:] if args is None else list(args))
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:  # bad options, missing arguments
            where = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) else ""
            click.echo(f"error: {exc.format_message()}{where}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: interrupted; no output was written", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MhaOnnxError as exc:
            self._fail(ctx, exc.message, exc.hint, exc.exit_code, type(exc).__name__)
        except KeyboardInterrupt:
            click.echo("error: interrupted; no output was written", err=True)
            ctx.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:  # a bug of mha-onnx, not the user's input
            self._fail(ctx, f"internal error: {type(exc).__name__}: {str(exc)[:300]}",
                       "please report it with the output of -v (the traceback)", EXIT_MISMATCH,
                       "InternalError")

    def _fail(self, ctx: click.Context, message: str, hint: str | None, code: int,
              kind: str) -> None:
        """One line on stderr (a JSON object on stdout under --json), then the exit code."""
        if ctx.obj and ctx.obj.get("verbose"):
            traceback.print_exc()
        if getattr(self, "as_json", False):
            click.echo(json.dumps({"error": message, "hint": hint, "kind": kind,
                                   "exit_code": code}, indent=2))
        else:
            click.echo(f"error: {message}" + (f" (hint: {hint})" if hint else ""), err=True)
        ctx.exit(code)


def _emit(report: Any, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        click.echo(report.render())


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging; -v also shows tracebacks.")
@click.version_option(__version__, prog_name="mha-onnx")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Multi-head attention from PyTorch to ONNX Runtime: export, fuse, validate, profile."""
    ctx.obj = {"verbose": verbose}
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if verbose < 2:
        for noisy in ("onnxscript", "onnx_ir", "torch"):  # their warnings are not the user's
            logging.getLogger(noisy).setLevel(logging.ERROR)
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)


@main.command()
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
@click.option("--weights", default=None, help="safetensors or torch state_dict (ours or nn.MultiheadAttention).")
@click.option("--opset", type=int, default=None, help="ONNX opset (default 20; 18 with --model).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default=None)
@click.option("--kv-cache", type=click.Choice(["appended", "shared"]), is_flag=False,
              flag_value="appended", default=None,
              help="Export with a KV cache (past_key/past_value in, present_* out); with --model, "
                   "the fused cache's form: appended (default) or shared (one buffer, in place).")
@click.option("--cache-padding", is_flag=True,
              help="With --kv-cache: a key padding mask over past + new keys.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of random weights.")
@click.option("-o", "--output", required=True, help="Where to write the .onnx file.")
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def export(model_dir, task, no_fuse, preset, config_file, attention, mask, weights, opset, dtype,
           kv_cache, cache_padding, seed, output, force, as_json):
    """Export the PyTorch reference (or, with --model, a Hugging Face model) to ONNX with
    dynamic batch and sequence axes."""
    from mha_onnx.config import load_config_file, load_preset
    from mha_onnx.errors import ConfigError
    from mha_onnx.export import export_model

    if model_dir:
        given = [n for n, v in (("--preset", preset), ("--config", config_file),
                                ("--attention", attention), ("--mask", mask),
                                ("--weights", weights), ("--cache-padding", cache_padding)) if v]
        if given:
            raise ConfigError(f"--model excludes {', '.join(given)}",
                              hint="the folder's config says what the model is")
        from mha_onnx.hf_export import HfExportConfig, export_hf

        cfg = HfExportConfig(task=task, dtype=dtype or "float32", opset=opset or 18,
                             fuse=not no_fuse, kv_cache=kv_cache or "appended", force=force)
        _emit(export_hf(model_dir, output, cfg, progress=lambda line: click.echo(
            f"[export] {line}", err=True)), as_json)
        return
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
    _emit(report, as_json)


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(model, as_json):
    """Summarise an ONNX model: IO, ops, attention blocks, parameters, metadata."""
    from mha_onnx.inspect import inspect_model

    _emit(inspect_model(model), as_json)


@main.command()
@click.argument("model")
@click.option("-o", "--output", required=True, help="Where to write the fused model.")
@click.option("--target", type=click.Choice(["ort", "onnx", "openvino"]), default="ort",
              show_default=True,
              help="ort: ONNX Runtime contrib kernels; onnx: the standard Attention op (opset 23); "
                   "openvino: onnx's standard ops, verified on OpenVINO as well.")
@click.option("--ep", type=click.Choice(EP_CHOICES), default="cpu",
              show_default=True,
              help="Execution provider the model will run on (target ort): the forms measured "
                   "fastest there (docs/fusion-forms.md for cpu, docs/gpu/ for cuda; tensorrt "
                   "runs ORT's attention kernels on CUDA).")
@click.option("--form", "forms", multiple=True,
              help=f"Override a kernel form (target ort): {form_help()}. Defaults: those of "
                   "--ep.")
@click.option("--kv-cache", "kv_cache", type=click.Choice(["appended", "shared"]),
              default="appended", show_default=True,
              help="KV-cache models: appended keeps the interface (presents = pasts + new); "
                   "shared makes each past a max-length buffer updated in place (a new "
                   "past_sequence_length input; bind past and present to one buffer).")
@click.option("--no-verify", is_flag=True, help="Skip the parity check against the original.")
@click.option("--atol", type=float, default=None, help="Verification tolerance (default by dtype).")
@click.option("--rtol", type=float, default=None)
@click.option("--inputs", "inputs_npz", default=None,
              help="Verify with these inputs (.npz, one array per input) instead of generated ones.")
@click.option("--strict", is_flag=True,
              help="Exit 1 and write nothing when any attention block is left unfused.")
@tune_options
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def fuse(model, output, target, ep, forms, kv_cache, no_verify, atol, rtol, inputs_npz, strict,
         tune, tune_batch, tune_seq_lens, tune_threads, force, as_json):
    """Rewrite every attention block onto the fastest fused kernel, verified against the
    original on ORT CPU before anything is written."""
    from mha_onnx.errors import ConfigError
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.lower.ort import Forms

    if tune and (target != "ort" or ep != "cpu" or forms or kv_cache != "appended"):
        raise ConfigError("--tune chooses the forms itself, on this machine's CPU",
                          hint="drop --target/--ep/--form/--kv-cache, or drop --tune")
    if tune:
        return _emit(run_tune(model, output, tune_batch, tune_seq_lens, tune_threads, force),
                     as_json)

    report = fuse_file(model, output, target=target, verify_result=not no_verify, force=force,
                       atol=atol, rtol=rtol, forms=Forms.parse(forms, ep), inputs=inputs_npz,
                       kv_cache=kv_cache, strict=strict)
    _emit(report, as_json)


@main.command()
@click.argument("model")
@click.option("--reference", default=None, help="Another ONNX model to compare with (e.g. the unfused original).")
@click.option("--providers", default="cpu", show_default=True,
              help="Comma list: cpu,cuda,tensorrt,openvino,openvino-bf16 (openvino:GPU: another OpenVINO device).")
@click.option("--shapes", default=None, help="B:S[:T],... (default: a sweep over every dynamic dim).")
@click.option("--atol", multiple=True, help="Absolute tolerance, or OUTPUT=VALUE for one output.")
@click.option("--rtol", multiple=True, help="Relative tolerance, or OUTPUT=VALUE for one output.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help="Intra-op threads for ORT.")
@click.option("--allow-missing", is_flag=True, help="Report providers that cannot run instead of failing.")
@click.option("--no-memory-check", is_flag=True, help="Run shapes whose estimated memory exceeds what is free.")
@click.option("--inputs", "inputs_npz", default=None, help="Feed these inputs (.npz) instead.")
@click.option("--save-outputs", default=None,
              help="Save inputs, outputs and provenance (.npz) to check on another machine.")
@click.option("--load-outputs", default=None,
              help="Run the inputs saved by --save-outputs here and compare with its outputs.")
@click.option("--strict", is_flag=True,
              help="Fail --load-outputs when the golden file was saved from another model.")
@click.option("--force", is_flag=True, help="Replace an existing --save-outputs file.")
@click.option("--bisect", "bisect_", is_flag=True,
              help="On a mismatch, name the first node whose output differs (against "
                   "--reference, or the same model on another provider).")
@click.option("--bisect-chunk", type=click.IntRange(min=1), default=256, show_default=True,
              help="Intermediate values exposed per run while bisecting (memory bound).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def validate(ctx, model, reference, providers, shapes, atol, rtol, seed, threads, allow_missing,
             no_memory_check, inputs_npz, save_outputs, load_outputs, strict, force, bisect_,
             bisect_chunk, as_json):
    """Parity of MODEL across PyTorch, ORT CPU, CUDA and TensorRT. Exit 0 when everything
    passed, 1 when outputs differ, 3 when a requested provider could not run."""
    from mha_onnx.graphio import read_model
    from mha_onnx.inputs import input_specs, parse_shapes
    from mha_onnx.parity import ValidateConfig, parse_tolerances, validate_model
    from mha_onnx.runtimes import parse_providers

    cases = tuple(parse_shapes(shapes, input_specs(read_model(model)))) if shapes else None
    config = ValidateConfig(
        providers=parse_providers(providers), shapes=cases,
        tolerances=parse_tolerances(atol, rtol), seed=seed, allow_missing=allow_missing,
        reference=reference, threads=threads, memory_check=not no_memory_check,
        inputs=inputs_npz, save_outputs=save_outputs, load_outputs=load_outputs, force=force,
        strict=strict, bisect=bisect_, bisect_chunk=bisect_chunk,
    )
    report = validate_model(model, config)
    _emit(report, as_json)
    ctx.exit(report.exit_code)


@main.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--providers", default="cpu", show_default=True,
              help="Comma list: cpu,cuda,tensorrt,openvino,openvino-bf16 (openvino:GPU: another OpenVINO device).")
@click.option("--batch", "batches", default="1", show_default=True, help="Comma list of batch sizes.")
@click.option("--seq-lens", default="128,512,2048", show_default=True, help="Comma list of sequence lengths.")
@click.option("--warmup", type=int, default=3, show_default=True)
@click.option("--iters", type=int, default=None,
              help="Exactly this many timed runs per point (default: >= 10 runs and >= 0.3 s).")
@click.option("--min-time", type=float, default=None,
              help="Time each point for at least this many seconds (>= 3 runs).")
@click.option("--threads", default=None, help="Intra-op thread counts, e.g. 1,2 (default: ORT's).")
@click.option("--interleave/--no-interleave", default=None,
              help="Run the models of each point in turn in one process: fair ratios on a "
                   "busy machine, no memory figures (default when comparing 2+ models; "
                   "--no-interleave: each point in a child process, with memory).")
@click.option("--keep-going", is_flag=True,
              help="Finish the sweep when a point fails (the exit code is 1 all the same).")
@click.option("--io-binding", is_flag=True, help="Keep inputs/outputs on the device (CUDA).")
@click.option("--pad-fraction", type=float, default=0.0, show_default=True,
              help="Fraction of trailing keys padded in mask inputs.")
@click.option("--inputs", "inputs_npz", default=None, help="Feed these inputs (.npz) instead.")
@click.option("--decode", is_flag=True, help="KV-cache models: time one new token per step.")
@click.option("--context", default=None, help="With --decode: cache lengths, e.g. 128,1024,4096.")
@click.option("--no-ops", is_flag=True, help="Skip the per-op breakdown.")
@click.option("--no-memory-check", is_flag=True, help="Run points whose estimated memory exceeds what is free.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--csv", "csv_path", default=None, help="Also write the points as CSV.")
@click.option("--plot", "plot_path", default=None, help="Also draw latency/memory vs length (PNG).")
@click.option("--trace", "trace_dir", default=None, help="Keep ORT's Chrome-trace JSON here.")
@click.option("--force", is_flag=True, help="Replace existing --csv/--plot files and --trace traces.")
@click.pass_context
def profile(ctx, models, providers, batches, seq_lens, warmup, iters, min_time, threads,
            interleave, keep_going, io_binding, pad_fraction, inputs_npz, decode, context, no_ops,
            no_memory_check, as_json, csv_path, plot_path, trace_dir, force):
    """Latency percentiles, throughput, GFLOP/s vs roofline, memory and per-op time."""
    from mha_onnx.graphio import prepare_folder, prepare_output
    from mha_onnx.profile import (
        DEFAULT_ITERS,
        DEFAULT_MIN_TIME,
        ProfileConfig,
        profile_models,
        write_csv,
    )
    from mha_onnx.profile import plot as draw
    from mha_onnx.runtimes import parse_providers

    for path in (csv_path, plot_path):  # refuse before the long run, not after it
        if path:
            prepare_output(path, force=force)
    if trace_dir:
        prepare_folder(trace_dir, force=force)
    if iters is None and min_time is None:
        iters, min_time = DEFAULT_ITERS, DEFAULT_MIN_TIME
    config = ProfileConfig(
        providers=parse_providers(providers), batches=int_list(batches, "--batch"),
        seq_lens=int_list(context or seq_lens, "--context" if context else "--seq-lens"),
        warmup=warmup, iters=iters, decode=decode,
        min_time=min_time, threads=thread_counts(threads), io_binding=io_binding, trace_dir=trace_dir,
        pad_fraction=pad_fraction, op_breakdown=not no_ops, memory_check=not no_memory_check,
        interleave=len(models) > 1 if interleave is None else interleave, inputs=inputs_npz,
        keep_going=keep_going)
    step, close = progress_bar()
    try:
        report = profile_models(models, config, on_point=step)
    finally:
        close()
    if csv_path:
        write_csv(report, csv_path, force=force)
    if plot_path:
        draw(report, plot_path, force=force)
    _emit(report, as_json)
    ctx.exit(0 if report else 1)  # a failed point is no result


@main.command()
@click.argument("model")
@click.option("-o", "--output", "repository", required=True, help="The model repository folder.")
@click.option("--name", default=None, help="Model name in the repository (default: the file's stem).")
@click.option("--max-batch-size", type=int, default=8, show_default=True)
@click.option("--target", "targets", multiple=True,
              type=click.Choice(["cpu", "cuda", "tensorrt", "openvino"]),
              help="A config per target (repeat; the first is config.pbtxt). Default: cpu.")
@click.option("--instances", type=int, default=1, show_default=True, help="Instances per device.")
@click.option("--target-model", "target_models", multiple=True, metavar="TARGET=MODEL",
              help="A model of its own for a target (one tuned there: `mha-onnx tune`), "
                   "loaded by that target's config (repeat).")
@click.option("--from-profile", default=None, help="A profile --json: batch sizes, queue delay, threads.")
@click.option("--lengths", default="1:128:2048", show_default=True,
              help="min:opt:max sequence length of TensorRT's optimisation profile.")
@click.option("--force", is_flag=True, help="Write into an existing model folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def package(model, repository, name, max_batch_size, targets, instances, target_models,
            from_profile, lengths, force, as_json):
    """Write a Triton Inference Server model repository (onnxruntime backend) for MODEL."""
    from pathlib import Path

    from mha_onnx.errors import ConfigError
    from mha_onnx.package import PackageConfig, package_model

    try:
        low, opt, high = (int(x) for x in lengths.split(":"))
    except ValueError:
        raise ConfigError(f"malformed --lengths {lengths!r}", hint="e.g. --lengths 1:128:2048") from None
    pairs = tuple(tuple(p.split("=", 1)) for p in target_models)
    if any(len(p) != 2 or not all(p) for p in pairs):
        raise ConfigError(f"malformed --target-model {target_models}",
                          hint="e.g. --target-model cuda=model.cuda.tuned.onnx")
    config = PackageConfig(name=name or Path(model).stem.replace(".", "_"),
                           max_batch_size=max_batch_size, targets=tuple(targets) or ("cpu",),
                           instances=instances, from_profile=from_profile,
                           lengths=(low, opt, high), force=force, target_models=pairs)
    _emit(package_model(model, repository, config), as_json)


@main.command()
@click.argument("profiles", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="The markdown report to write.")
@click.option("--plot", "plot_path", default=None, help="Also draw the targets side by side (PNG).")
@click.option("--force", is_flag=True, help="Replace existing output files.")
@click.option("--json", "as_json", is_flag=True, help="Print the merged table as JSON.")
def report(profiles, output, plot_path, force, as_json):
    """Merge profile --json files from several machines and providers into one table."""
    from mha_onnx.report import merge_profiles, write_report

    merged = merge_profiles(list(profiles))
    write_report(merged, output, plot_path, force=force)
    _emit(merged, as_json)


main.add_command(tune_command)


def run() -> None:  # pragma: no cover - console entry point
    main(prog_name="mha-onnx")


if __name__ == "__main__":  # pragma: no cover
    main(prog_name="mha-onnx")
