"""`validate`: parity across runtimes and references."""

from __future__ import annotations

import click

from mha_onnx.cli.options import emit


@click.command("validate")
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
@click.option("--ranges", is_flag=True,
              help="Every activation's largest magnitude against float16's range: the values "
                   "past a quarter of it named, and the first node that makes inf/NaN out of "
                   "finite inputs (a failure).")
@click.option("--bisect-chunk", type=click.IntRange(min=1), default=256, show_default=True,
              help="Intermediate values exposed per run while bisecting (memory bound).")
@click.option("--max-kl", type=float, default=None,
              help="A quantized model: most mean next-token KL against its float model "
                   "(default: as it was quantized with, else 0.05).")
@click.option("--min-top1", type=float, default=None,
              help="A quantized model: least top-1 agreement (default: as it was quantized "
                   "with, else 0.80).")
@click.option("--min-cosine", type=float, default=None,
              help="A quantized model: least mean cosine of every output (default: as it "
                   "was quantized with, else 0.95).")
@click.option("--min-greedy", type=float, default=None,
              help="A quantized model: least greedy agreement (default: as it was quantized "
                   "with, else reported only).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def validate(ctx, model, reference, providers, shapes, atol, rtol, seed, threads, allow_missing,
             no_memory_check, inputs_npz, save_outputs, load_outputs, strict, force, bisect_,
             bisect_chunk, ranges, max_kl, min_top1, min_cosine, min_greedy, as_json):
    """Parity of MODEL across PyTorch, ORT CPU, CUDA and TensorRT (a quantized model: its
    accuracy against its float original). Exit 0 when everything passed, 1 when outputs
    differ, 3 when a requested provider could not run."""
    from mha_onnx.graph.files import read_model
    from mha_onnx.graph.inputs import input_specs, parse_shapes
    from mha_onnx.parity import ValidateConfig, parse_tolerances, validate_model
    from mha_onnx.runtime.ort import parse_providers

    cases = tuple(parse_shapes(shapes, input_specs(read_model(model)))) if shapes else None
    config = ValidateConfig(
        providers=parse_providers(providers), shapes=cases,
        tolerances=parse_tolerances(atol, rtol), seed=seed, allow_missing=allow_missing,
        reference=reference, threads=threads, memory_check=not no_memory_check,
        inputs=inputs_npz, save_outputs=save_outputs, load_outputs=load_outputs, force=force,
        strict=strict, bisect=bisect_, bisect_chunk=bisect_chunk, ranges=ranges,
        accuracy={k: v for k, v in (("max_kl", max_kl), ("min_top1", min_top1),
                                    ("min_cosine", min_cosine), ("min_greedy", min_greedy))
                  if v is not None},
        progress=(lambda _: None) if as_json else (
            lambda line: click.echo(f"[validate] {line}", err=True)),
    )
    report = validate_model(model, config)
    if as_json:
        emit(report, as_json)
    else:  # a summary; -v: every comparison
        click.echo(report.render(detail=bool(ctx.obj and ctx.obj.get("verbose"))))
    ctx.exit(report.exit_code)
