"""One runner per provider name: ONNX Runtime's execution providers or OpenVINO."""

from __future__ import annotations

import os
from typing import Any

from mha_onnx.runtime_openvino import OpenVinoRunner, is_openvino
from mha_onnx.runtimes import OrtRunner


def make_runner(model: str | os.PathLike[str] | bytes, provider: str = "cpu", **options: Any
                ) -> OrtRunner | OpenVinoRunner:
    """``OrtRunner(model, provider, **options)``, or an OpenVinoRunner for ``openvino*``
    (which takes ``threads`` and ignores the ORT-only options: IO binding, optimisation
    level, profiling)."""
    if is_openvino(provider):
        return OpenVinoRunner(model, provider, **options)
    return OrtRunner(model, provider, **options)
