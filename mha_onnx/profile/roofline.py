"""The machine a profile ran on, and its practical ceiling for the attention's matrix
products: the GFLOP/s of large square MatMuls on the same provider and threads."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np


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


def matmul_roofline(provider: str, threads: int | None, dtype: str = "float32") -> float:
    """GFLOP/s of large square MatMuls on ``provider`` (best of several runs and sizes)."""
    from onnx import TensorProto, helper

    from mha_onnx.runtime import capabilities, make_runner

    on_cpu = capabilities(provider).device == "CPU"
    sizes = (512, 1024, 2048) if on_cpu else (4096, 8192)
    elem = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    np_dtype = np.float16 if dtype == "float16" else np.float32
    rng = np.random.default_rng(0)
    best = 0.0
    for n in sizes:
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["a", "b"], ["c"])], "roofline",
            [helper.make_tensor_value_info("a", elem, [n, n]),
             helper.make_tensor_value_info("b", elem, [n, n])],
            [helper.make_tensor_value_info("c", elem, [n, n])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        feeds = {"a": rng.standard_normal((n, n)).astype(np_dtype),
                 "b": rng.standard_normal((n, n)).astype(np_dtype)}
        with make_runner(model.SerializeToString(), provider, threads=threads,
                       io_binding=provider != "cpu") as runner:
            runner.infer(feeds)
            seconds = min(_timed(runner, feeds) for _ in range(10))
        best = max(best, 2.0 * n**3 / seconds / 1e9)
    return best


def _timed(runner: Any, feeds: dict[str, np.ndarray]) -> float:
    start = time.perf_counter()
    runner.infer(feeds)
    return time.perf_counter() - start


def memory_bandwidth(provider: str, threads: int | None) -> float:
    """GB/s of reading 256 MB once on ``provider``, the way a decode step reads: a vector
    times a [8192, 8192] matrix (what a step does with every weight; multi-threaded like the
    layer) and a ReduceSum over the same bytes; the faster of the two, best of several runs.
    The ceiling of a decode step, which reads its weights and its KV cache once."""
    from onnx import TensorProto, helper

    from mha_onnx.runtime import make_runner

    side = 8192
    probes = {
        "gemv": ([helper.make_node("MatMul", ["v", "x"], ["y"])],
                 [("v", [1, side]), ("x", [side, side])], [1, side]),
        "sum": ([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
                [("x", [side * side])], []),
    }
    best = 0.0
    for nodes, inputs, out in probes.values():
        graph = helper.make_graph(
            nodes, "bandwidth",
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                  ir_version=8)
        feeds = {name: np.ones(shape, np.float32) for name, shape in inputs}
        with make_runner(model.SerializeToString(), provider, threads=threads,
                       io_binding=provider != "cpu") as runner:
            runner.infer(feeds)
            seconds = min(_timed(runner, feeds) for _ in range(7))
        best = max(best, 4 * side * side / seconds / 1e9)
    return best
