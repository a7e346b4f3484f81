"""`inspect`: what a model is."""

from __future__ import annotations

import click

from mha_onnx.cli.options import emit


@click.command("inspect")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(model, as_json):
    """Summarise an ONNX model: IO, ops, attention blocks, parameters, metadata."""
    from mha_onnx.rewrite.inspect import inspect_model

    emit(inspect_model(model), as_json)
