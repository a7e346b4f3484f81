"""The CLI of packaging: `mha-onnx package` (see mha_onnx.package)."""

from __future__ import annotations

import click

from mha_onnx.cli.options import emit


@click.command("package")
@click.argument("model")
@click.option("-o", "--output", "repository", required=True, help="The model repository folder.")
@click.option("--name", default=None,
              help="Model name in the repository (default: the file's stem, or its folder's "
                   "name for a model.onnx).")
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
@click.option("--stateless", is_flag=True,
              help="A decoder with a KV cache served as any model: every request sends and "
                   "receives the whole cache (default: stateful, the cache on the server).")
@click.option("--force", is_flag=True, help="Write into an existing model folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def package_command(model, repository, name, max_batch_size, targets, instances, target_models,
            from_profile, lengths, stateless, force, as_json):
    """Write a Triton Inference Server model repository (onnxruntime backend) for MODEL."""
    from pathlib import Path

    from mha_onnx.errors import ConfigError
    from mha_onnx.package.repository import PackageConfig, package_model

    try:
        low, opt, high = (int(x) for x in lengths.split(":"))
    except ValueError:
        raise ConfigError(f"malformed --lengths {lengths!r}", hint="e.g. --lengths 1:128:2048") from None
    pairs = tuple(tuple(p.split("=", 1)) for p in target_models)
    if any(len(p) != 2 or not all(p) for p in pairs):
        raise ConfigError(f"malformed --target-model {target_models}",
                          hint="e.g. --target-model cuda=model.cuda.tuned.onnx")
    config = PackageConfig(name=name or _default_name(Path(model)),
                           max_batch_size=max_batch_size, targets=tuple(targets) or ("cpu",),
                           instances=instances, from_profile=from_profile,
                           lengths=(low, opt, high), force=force, target_models=pairs,
                           stateless=stateless)
    emit(package_model(model, repository, config), as_json)


def _default_name(model) -> str:
    """The file's stem; a ``model.onnx`` (as export, fuse and quantize name their outputs in
    folders of their own) by its folder's name, so that two such models are not both "model"."""
    stem = model.stem if model.stem != "model" else model.resolve().parent.name
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in stem) or "model"
