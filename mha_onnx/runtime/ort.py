"""ONNX Runtime sessions per execution provider, strict about which provider really ran.

One small protocol: ``OrtRunner(model, provider)`` builds its session lazily, ``infer(feeds)``
returns ``{output name: np.ndarray}``, and it is a context manager. A requested provider that
ORT cannot load raises :class:`ProviderUnavailableError` with ORT's own reason; it is never
replaced by the CPU behind the caller's back.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.errors import ConfigError, ModelFileError, ProviderError
from mha_onnx.runtime.base import Capabilities, Runner

log = logging.getLogger(__name__)

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
SHORT_NAMES = {v: k for k, v in PROVIDERS.items()}
# A second runtime (mha_onnx.runtime.openvino): f32 pinned, and its reduced precision; each
# takes an OpenVINO device after a colon (openvino:GPU).
OPENVINO = ("openvino", "openvino-bf16")
# Our names for ORT's graph optimisation levels, from the most to the least optimised.
LEVELS = {"all": "ORT_ENABLE_ALL", "extended": "ORT_ENABLE_EXTENDED",
          "basic": "ORT_ENABLE_BASIC", "none": "ORT_DISABLE_ALL"}


class ProviderUnavailableError(ProviderError):
    """ORT knows the provider but could not start it here (missing libraries, no device)."""


def parse_providers(text: str) -> tuple[str, ...]:
    """``"cpu,cuda"`` -> ("cpu", "cuda"); unknown names raise with the known ones."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError("no execution provider given", hint="e.g. --providers cpu,cuda")
    for name in names:
        if name not in PROVIDERS and name.split(":", 1)[0] not in OPENVINO:
            raise ConfigError(
                f"unknown execution provider {name!r}",
                hint=f"known providers: {', '.join((*PROVIDERS, *OPENVINO))} "
                     "(openvino[-bf16]:DEVICE for another OpenVINO device)",
            )
    return tuple(dict.fromkeys(names))


_PRELOADED = False


def import_ort(*, for_gpu: bool = False) -> Any:
    """onnxruntime; for a GPU session, with CUDA/cuDNN libraries from pip packages preloaded
    (once, quietly) so that the CUDA EP can find them. CPU sessions skip that: it maps large
    libraries into the process for nothing."""
    global _PRELOADED
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)
    if (for_gpu and not _PRELOADED and preload is not None
            and PROVIDERS["cuda"] in ort.get_available_providers()):
        _PRELOADED = True
        # torch, where installed, loads the CUDA/cuDNN libraries its wheels carry (globally),
        # which is how ORT's CUDA provider finds them beside a CUDA build of torch.
        with contextlib.suppress(Exception):
            import torch  # noqa: F401
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Exception):
            _capture_native_stderr(preload)
    return ort


def _capture_native_stderr(func: Any) -> tuple[Any, str]:
    """Run ``func`` while capturing native stderr; returns (result, captured text)."""
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            try:
                result = func()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        except Exception:
            sink.seek(0)
            log.debug("native stderr: %s", sink.read().decode(errors="replace"))
            raise
        sink.seek(0)
        return result, sink.read().decode(errors="replace")


def _ort_reason(captured: str) -> str:
    """The most telling line of what ORT logged while it failed to start a provider."""
    lines = [ln.strip() for ln in captured.splitlines() if ln.strip()]
    for key in ("Failed to load library", "Error loading", "cannot open shared object",
                "CUDA failure", "no CUDA-capable device", "LoadLibrary"):
        for line in lines:
            if key in line:
                return line[line.find(key) :].strip()
    return lines[-1] if lines else "onnxruntime did not register it (no reason logged)"


class _SessionFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SessionInfo:
    provider: str
    providers_in_session: tuple[str, ...]
    create_seconds: float
    cpu_fallback_allowed: bool


class OrtRunner(Runner):
    """One ORT session on one execution provider (plus the CPU only where ORT must place
    shape ops there, and only when ``strict=False``)."""

    @classmethod
    def capabilities(cls, provider: str) -> Capabilities:
        return Capabilities("onnxruntime", f"ort {provider}", provider.upper(),
                            child_preflight=True, op_profile=True,
                            places_nodes_on_cpu=provider != "cpu")

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes,
        provider: str = "cpu",
        *,
        threads: int | None = None,
        io_binding: bool = False,
        profile_dir: str | os.PathLike[str] | None = None,
        strict: bool = True,
        optimization: str = "all",
        spinning: bool = True,
        tf32: bool = False,
        initializers: Mapping[str, Any] | None = None,
        stop_spinning: bool = False,
        external_data_dir: str | os.PathLike[str] | None = None,
        prepacking: bool = True,
    ) -> None:
        if provider not in PROVIDERS:
            raise ProviderError(
                f"unknown execution provider {provider!r}",
                hint=f"known providers: {', '.join(PROVIDERS)}",
            )
        self.model = model
        self.provider = provider
        self.threads = threads
        self.io_binding = io_binding and provider != "cpu"
        self.profile_dir = profile_dir
        self.strict = strict
        self.optimization = optimization
        self.spinning = spinning
        self.tf32 = tf32
        self.initializers = dict(initializers or {})  # name -> OrtValue (shared, not copied)
        self.stop_spinning = stop_spinning  # pool threads spin within a run, not after it
        self.external_data_dir = external_data_dir  # a model in bytes: where its data lies
        self.prepacking = prepacking  # False: MatMuls read their weights as the file has them
        self._session: Any = None
        self._quiet_run: Any = None
        self.info: SessionInfo | None = None

    def close(self) -> None:
        self._session = None

    @property
    def session(self) -> Any:
        if self._session is None:
            self._session = self._create()
        return self._session

    def _options(self, ort: Any, allow_fallback: bool) -> Any:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if self.threads:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        if not self.spinning:  # idle pool threads sleep instead of spinning (shared CPUs)
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        elif self.stop_spinning:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                                   LEVELS[self.optimization])
        if self.provider != "cpu" and not allow_fallback:
            options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        if self.profile_dir is not None:
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(self.profile_dir) / "ort_profile")
        for name, value in self.initializers.items():
            options.add_initializer(name, value)
        if not self.prepacking:  # (no packed copy of each weight: a check's session)
            options.add_session_config_entry("session.disable_prepacking", "1")
        if self.external_data_dir is not None:
            options.add_session_config_entry(
                "session.model_external_initializers_file_folder_path",
                str(self.external_data_dir))
        return options

    def _create(self) -> Any:
        ort = import_ort(for_gpu=self.provider != "cpu")
        wanted = PROVIDERS[self.provider]
        if wanted not in ort.get_available_providers():
            available = ", ".join(SHORT_NAMES.get(p, p) for p in ort.get_available_providers())
            raise ProviderUnavailableError(
                f"execution provider {self.provider} is not in this onnxruntime build",
                hint=f"available: {available}",
            )
        source = self.model if isinstance(self.model, bytes) else str(self.model)
        start = time.perf_counter()
        if self.provider == "cpu":
            session = self._session_or_error(ort, source, [wanted], allow_fallback=True)[0]
            self.info = SessionInfo("cpu", (wanted,), time.perf_counter() - start, False)
            return session
        # First ask for every node on the device, with ORT's CPU fallback disabled.
        device = (wanted, self._provider_options())
        try:
            session, captured = self._session_or_error(ort, source, [device], allow_fallback=False)
            allow_fallback = False
        except _SessionFailed as failed:
            # Either the EP cannot start at all, or some nodes can only run on the CPU.
            session, captured = self._session_or_error(
                ort, source, [device, PROVIDERS["cpu"]], allow_fallback=True
            )
            if wanted in session.get_providers() and self.strict:
                raise ProviderUnavailableError(
                    f"execution provider {self.provider} cannot run every node: {failed.reason}",
                    hint="drop strict mode to let ORT place those nodes on the CPU (reported)",
                ) from None
            allow_fallback = True
        got = tuple(session.get_providers())
        if wanted not in got:
            raise ProviderUnavailableError(
                f"execution provider {self.provider} could not be loaded: {_ort_reason(captured)}",
                hint="onnxruntime would have run on the CPU instead; that is never reported as "
                + self.provider,
            )
        self.info = SessionInfo(self.provider, got, time.perf_counter() - start, allow_fallback)
        return session

    def _provider_options(self) -> dict[str, str]:
        """CUDA: float32 MatMuls in float32. ORT's CUDA provider rounds them through TF32 by
        default (about 1e-3 relative), which silently changes a float32 model's results;
        ``tf32=True`` measures that default instead."""
        if self.provider == "cuda":
            return {"use_tf32": "1" if self.tf32 else "0"}
        return {}

    def _session_or_error(
        self, ort: Any, source: Any, providers: list[Any], *, allow_fallback: bool
    ) -> tuple[Any, str]:
        options = self._options(ort, allow_fallback)
        try:
            return _capture_native_stderr(
                lambda: ort.InferenceSession(source, options, providers=providers)
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            if not type(exc).__module__.startswith("onnxruntime"):
                raise
            if not allow_fallback:
                raise _SessionFailed(_short(str(exc))) from exc
            raise ModelFileError(f"onnxruntime cannot load the model: {_short(str(exc))}") from exc

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.session.get_inputs()]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once; outputs come back as numpy arrays on the host."""
        session = self.session
        try:
            if self.io_binding:
                return self._infer_bound(feeds)
            values = session.run(None, dict(feeds), self._run_options())
        except Exception as exc:
            if type(exc).__module__.startswith("onnxruntime"):
                raise ModelFileError(f"onnxruntime failed to run the model: {_short(str(exc))}") from exc
            raise
        return dict(zip(self.output_names, values, strict=True))

    def _run_options(self) -> Any:
        """Errors come back as exceptions; ORT need not also print them."""
        if self._quiet_run is None:
            self._quiet_run = import_ort(for_gpu=self.provider != "cpu").RunOptions()
            self._quiet_run.log_severity_level = 4
        return self._quiet_run

    def _infer_bound(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inputs copied to the device once, outputs allocated there (IO binding)."""
        ort = import_ort(for_gpu=True)
        device = "cuda"
        binding = self.session.io_binding()
        for name, array in feeds.items():
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), device, 0)
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, device, 0)
        self.session.run_with_iobinding(binding, self._run_options())
        outputs = binding.copy_outputs_to_cpu()
        return dict(zip(self.output_names, outputs, strict=True))

    def end_profiling(self) -> str | None:
        if self._session is None or self.profile_dir is None:
            return None
        return self._session.end_profiling()


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) < 500 else text[:240] + " ... " + text[-240:]


def cuda_available() -> tuple[bool, str]:
    """Whether a CUDA EP session really starts here; the reason when it does not."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    try:
        with OrtRunner(model.SerializeToString(), "cuda") as runner:
            runner.infer({"x": np.ones(1, np.float32)})
    except ProviderError as exc:
        return False, str(exc)
    return True, ""


@dataclass(frozen=True)
class NodeEvent:
    """One node execution from ORT's profiler."""

    name: str
    op_type: str
    provider: str
    micros: float


def read_profile(path: str | os.PathLike[str]) -> list[NodeEvent]:
    """Node events of an ORT Chrome-trace profile (kernel time per node run)."""
    import json

    events = json.loads(Path(path).read_text())
    out = []
    for event in events:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith("_kernel_time"):
            continue
        args = event.get("args", {})
        out.append(
            NodeEvent(
                name=str(event["name"])[: -len("_kernel_time")],
                op_type=str(args.get("op_name", "?")),
                provider=SHORT_NAMES.get(str(args.get("provider", "")), str(args.get("provider", "?"))),
                micros=float(event.get("dur", 0.0)),
            )
        )
    return out


def node_placement(
    model: str | os.PathLike[str] | bytes, provider: str, feeds: Mapping[str, np.ndarray]
) -> dict[str, tuple[str, str]]:
    """node name -> (op type, provider that ran it), from one profiled run."""
    with tempfile.TemporaryDirectory(prefix="mha_onnx_prof_") as folder:
        runner = OrtRunner(model, provider, profile_dir=folder, io_binding=provider != "cpu",
                           strict=False)
        try:
            runner.infer(feeds)
            trace = runner.end_profiling()
        finally:
            runner.close()
        if trace is None:
            return {}
        return {e.name: (e.op_type, e.provider) for e in read_profile(trace)}
