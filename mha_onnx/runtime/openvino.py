"""OpenVINO as a second runtime, behind the same protocol as :class:`~mha_onnx.runtime.ort.OrtRunner`.

Provider names: ``openvino`` (OpenVINO's CPU device with INFERENCE_PRECISION_HINT pinned to
f32, so that an fp32 model computes in fp32) and ``openvino-bf16`` (the device's own reduced
precision: on CPUs with AMX/AVX512-BF16 OpenVINO's default is bf16, which changes an fp32
model's results by ~1e-3 without a word; validate compares it at bf16 tolerances and labels
it so). ``openvino:GPU`` / ``openvino-bf16:NPU`` pick another OpenVINO device where the
machine has one. OpenVINO absent, the device absent, or the model refused by its ONNX
frontend or compiler: :class:`ProviderUnavailableError` with OpenVINO's own reason (exit 3),
never a silent fallback to another runtime.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.errors import ConfigError, ModelFileError, ProviderError
from mha_onnx.runtime.base import Capabilities, Runner
from mha_onnx.runtime.ort import OPENVINO, ProviderUnavailableError, SessionInfo

FAMILY, REDUCED = OPENVINO


def is_openvino(provider: str) -> bool:
    return provider.split(":", 1)[0] in (FAMILY, REDUCED)


def reduced_precision(provider: str) -> bool:
    """Whether ``provider`` computes float32 models in the device's reduced precision."""
    return provider.split(":", 1)[0] == REDUCED


def device_of(provider: str) -> str:
    """``openvino:GPU`` -> GPU; ``openvino`` -> CPU."""
    _, _, device = provider.partition(":")
    return device.upper() or "CPU"


def import_openvino() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise ProviderUnavailableError(
            f"OpenVINO is not installed ({exc})",
            hint="pip install 'mha-onnx[openvino]' (or openvino==2026.4.1)") from None
    return openvino


def user_properties() -> dict[str, str]:
    """OpenVINO properties from the environment (MHA_ONNX_OPENVINO_CONFIG="K=V,K=V"): one
    setting for validate, profile and the child processes profile measures in."""
    text = os.environ.get("MHA_ONNX_OPENVINO_CONFIG", "")
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"malformed MHA_ONNX_OPENVINO_CONFIG item {item!r}",
                              hint="KEY=VALUE,KEY=VALUE (OpenVINO property names)")
        out[key.strip()] = value.strip()
    return out


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 600 else text[:600] + " ..."


class OpenVinoRunner(Runner):
    """One compiled OpenVINO model on one device; ``infer(feeds)`` -> {output name: array}."""

    @classmethod
    def capabilities(cls, provider: str) -> Capabilities:
        return Capabilities("openvino", provider, device_of(provider), child_preflight=False,
                            op_profile=False, places_nodes_on_cpu=False)

    def __init__(self, model: str | os.PathLike[str] | bytes, provider: str = FAMILY, *,
                 threads: int | None = None, **_ignored: Any) -> None:
        if not is_openvino(provider):
            raise ProviderError(f"not an OpenVINO provider: {provider!r}")
        self.model = model
        self.provider = provider
        self.threads = threads
        self.io_binding = False
        self.info: Any = None
        self._compiled: Any = None
        self._request: Any = None
        self._names: list[str] = []
        self.precision = ""

    def close(self) -> None:
        self._compiled = self._request = None

    @property
    def session(self) -> Any:
        if self._compiled is None:
            self._compiled = self._compile()
        return self._compiled

    def _config(self) -> dict[str, str]:
        """f32 pinned (but for openvino-bf16), the thread count, then the user's properties
        from MHA_ONNX_OPENVINO_CONFIG="KEY=VALUE,..." (e.g. CPU_RUNTIME_CACHE_CAPACITY=0,
        the workaround of the shape-cache bug in docs/history/bench-notebook.md), which win."""
        config = {}
        if not reduced_precision(self.provider):
            config["INFERENCE_PRECISION_HINT"] = "f32"
        if self.threads and device_of(self.provider) == "CPU":
            config["INFERENCE_NUM_THREADS"] = str(self.threads)
        return {**config, **user_properties()}

    def _compile(self) -> Any:
        ov = import_openvino()
        core = ov.Core()
        device = device_of(self.provider)
        if device not in core.available_devices:
            raise ProviderUnavailableError(
                f"OpenVINO device {device} is not on this machine",
                hint=f"OpenVINO devices here: {', '.join(core.available_devices) or 'none'}")
        start = time.perf_counter()
        try:
            if isinstance(self.model, bytes):
                with tempfile.TemporaryDirectory(prefix="mha_onnx_ov_") as folder:
                    path = Path(folder) / "model.onnx"
                    path.write_bytes(self.model)
                    read = core.read_model(str(path))
            else:
                read = core.read_model(str(self.model))
            compiled = core.compile_model(read, device, self._config())
        except Exception as exc:  # OpenVINO raises its own RuntimeError subclasses
            raise ProviderUnavailableError(
                f"OpenVINO ({device}) cannot compile the model: {_short(exc)}",
                hint="`mha-onnx fuse --target onnx` writes standard ops only") from None
        hint = compiled.get_property("INFERENCE_PRECISION_HINT") if device == "CPU" else None
        self.precision = getattr(hint, "to_string", lambda: str(hint))() if hint else ""
        # the names of the model as read: compiling may merge a tensor's names into the
        # port (an output and the value it copies), and any_name may then pick the other one
        self._names = [port.get_any_name() for port in read.outputs]
        self._request = compiled.create_infer_request()
        given = ", ".join(f"{k}={v}" for k, v in user_properties().items())
        label = (f"OpenVINO {ov.__version__.split('-')[0]} {device}"
                 f"{' ' + self.precision if self.precision else ''}{f' ({given})' if given else ''}")
        self.info = SessionInfo(self.provider, (label,), time.perf_counter() - start, False)
        return compiled

    @property
    def input_names(self) -> list[str]:
        return [port.get_any_name() for port in self.session.inputs]

    @property
    def output_names(self) -> list[str]:
        self.session  # noqa: B018
        return list(self._names)

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.session  # noqa: B018
        try:
            # np.require, not ascontiguousarray: that makes a scalar input one-dimensional
            result = self._request.infer({name: np.require(a, requirements="C")
                                          for name, a in feeds.items()})
        except Exception as exc:
            raise ModelFileError(f"OpenVINO failed to run the model: {_short(exc)}") from None
        return {name: np.array(result[port], copy=True)
                for name, port in zip(self._names, self.session.outputs, strict=True)}

    def end_profiling(self) -> str | None:
        return None
