"""``python -m mha_onnx.cli``: the command line."""

from mha_onnx.cli import run

run()
