"""The machine a run is on: its CPU (name, vector extensions, vendor), its GPU, and the
versions a result depends on; what profiles, validation reports and the generator's choice
of prompt session read."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    return _field(None, "model name").strip() or platform.processor() or platform.machine()


def cpu_isa(cpuinfo: str | None = None) -> str | None:
    """The widest vector extension the CPU reports (AMX, AVX-512 VNNI, AVX-VNNI, AVX-512,
    AVX2), None where /proc/cpuinfo does not say: two machines of one model name can differ
    here, and ONNX Runtime's int8 and 4-bit kernels with them (the same 'AMD EPYC' read a
    1024-token int4 prompt 1.27x and 0.81x of float32). ``cpuinfo``: the text to read,
    /proc/cpuinfo's by default."""
    flags = _field(cpuinfo, "flags").split()
    for flag, name in (("amx_tile", "AMX"), ("avx512_vnni", "AVX-512 VNNI"),
                       ("avx_vnni", "AVX-VNNI"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return None


def cpu_vendor(cpuinfo: str | None = None) -> str | None:
    """The CPU's vendor as /proc/cpuinfo names it ('AuthenticAMD', 'GenuineIntel'), or None.
    ``cpuinfo``: as :func:`cpu_isa`."""
    return _field(cpuinfo, "vendor_id").strip() or None


def cpuinfo_text() -> str:
    """/proc/cpuinfo's text, '' where it cannot be read (read once by a caller that asks
    :func:`cpu_isa` and :func:`cpu_vendor` both)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(cpuinfo: str | None, name: str) -> str:
    """The first ``name: ...`` line's value in ``cpuinfo`` (/proc/cpuinfo's text by default),
    '' where there is none."""
    text = cpuinfo_text() if cpuinfo is None else cpuinfo
    return next((line.split(":", 1)[1] for line in text.splitlines()
                 if line.split(":", 1)[0].strip() == name and ":" in line), "")


def gpu_info() -> dict[str, Any] | None:
    """Name and memory of GPU 0 (NVML), or None where there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        return {"name": name.decode() if isinstance(name, bytes) else str(name), "bytes": int(memory)}
    except Exception:  # noqa: BLE001 - NVML is optional
        return None


def machine_info() -> dict[str, Any]:
    """What a profile needs to say about where it ran, to be compared with others."""
    from importlib import metadata as dist

    import onnxruntime as ort

    try:  # the second runtime, where it is installed (its version without importing it)
        openvino = dist.version("openvino")
    except dist.PackageNotFoundError:
        openvino = None
    return {"machine": platform.machine(), "processor": cpu_name(), "isa": cpu_isa(),
            "cpus": os.cpu_count(), "gpu": gpu_info(), "onnxruntime": ort.__version__,
            "openvino": openvino, "python": platform.python_version(),
            "hostname": platform.node()}
