"""The practical ceiling of a machine for the attention's matrix products: the GFLOP/s of
large square MatMuls (and the memory bandwidth) on the same provider and threads. What the
machine is: runtime/machine.py (its names are here too, for the profile's readers)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mha_onnx.runtime.machine import (  # noqa: F401 (the profile's names for them)
    cpu_isa,
    cpu_name,
    cpu_vendor,
    cpuinfo_text,
    gpu_info,
    machine_info,
)


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
