"""The mha-onnx command line: one module per command, each parsing options, building a
config, calling one library function and printing its report. Heavy imports happen inside
commands so ``--help`` stays instant."""

from __future__ import annotations

from mha_onnx.cli.export import export
from mha_onnx.cli.fuse import fuse
from mha_onnx.cli.generate import generate_command
from mha_onnx.cli.group import main
from mha_onnx.cli.inspect import inspect
from mha_onnx.cli.package import package_command
from mha_onnx.cli.profile import profile
from mha_onnx.cli.quantize import quantize
from mha_onnx.cli.report import report
from mha_onnx.cli.serve import serve_command
from mha_onnx.cli.tune import tune_command
from mha_onnx.cli.validate import validate

for _command in (export, inspect, fuse, validate, profile, package_command, report, tune_command,
                 generate_command, quantize, serve_command):
    main.add_command(_command)


def run() -> None:  # pragma: no cover - console entry point
    main(prog_name="mha-onnx")


__all__ = ["main", "run"]
