"""Runtimes: one runner per provider name (ONNX Runtime's execution providers in ort.py,
OpenVINO in openvino.py, both on base.Runner), what each can do (``capabilities``), and
ORT meeting a model in a child process first (preflight.py)."""

from __future__ import annotations

import os
from typing import Any

from mha_onnx.runtime.base import Capabilities
from mha_onnx.runtime.openvino import OpenVinoRunner, is_openvino
from mha_onnx.runtime.ort import OrtRunner


def make_runner(model: str | os.PathLike[str] | bytes, provider: str = "cpu", **options: Any
                ) -> OrtRunner | OpenVinoRunner:
    """``OrtRunner(model, provider, **options)``, or an OpenVinoRunner for ``openvino*``
    (which takes ``threads`` and ignores the ORT-only options: IO binding, optimisation
    level, profiling)."""
    if is_openvino(provider):
        return OpenVinoRunner(model, provider, **options)
    return OrtRunner(model, provider, **options)


def capabilities(provider: str) -> Capabilities:
    """What the runtime behind ``provider`` can do (see ort.Capabilities)."""
    runner = OpenVinoRunner if is_openvino(provider) else OrtRunner
    return runner.capabilities(provider)
