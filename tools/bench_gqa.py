"""ONNX Runtime's CPU GroupQueryAttention timed alone, one node in a model of its own: a
decode step (one new token over ``past`` cached positions, in place on a shared buffer of
``--max-length``) and a prompt (``--prompt`` tokens, empty past), with a float32 cache and
with an int8 one (per-tensor scales, ``kv_cache_bit_width`` 8), 16 query heads over 4 K/V
heads of 64 (the 16-layer bench model's layer).

    .venv/bin/python -m tools.bench_gqa [--past 640,4000] [--prompt 512,3584] [--threads 2]

Prints one line per point: microseconds per decode call, milliseconds per prompt call.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

HEADS, KV_HEADS, HEAD = 16, 4, 64


def _model(batch: int, new: int, buffer: int, int8: bool):
    from onnx import TensorProto as T
    from onnx import helper as h

    cache = T.INT8 if int8 else T.FLOAT
    inputs = ["qkv", "", "", "pk", "pv", "seqlens", "total", "", ""]
    inits, attrs = [], {"num_heads": HEADS, "kv_num_heads": KV_HEADS}
    if int8:
        inits = [h.make_tensor("ks", T.FLOAT, [1], [0.05]), h.make_tensor("vs", T.FLOAT, [1], [0.05])]
        inputs += ["", "", "", "ks", "vs"]
        attrs.update(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8)
    node = h.make_node("GroupQueryAttention", inputs, ["o", "k", "v"], domain="com.microsoft",
                       **attrs)
    graph = h.make_graph(
        [node], "gqa",
        [h.make_tensor_value_info("qkv", T.FLOAT, [batch, new, (HEADS + 2 * KV_HEADS) * HEAD]),
         h.make_tensor_value_info("pk", cache, [batch, KV_HEADS, buffer, HEAD]),
         h.make_tensor_value_info("pv", cache, [batch, KV_HEADS, buffer, HEAD]),
         h.make_tensor_value_info("seqlens", T.INT32, [batch]),
         h.make_tensor_value_info("total", T.INT32, [])],
        [h.make_tensor_value_info("o", T.FLOAT, None), h.make_tensor_value_info("k", cache, None),
         h.make_tensor_value_info("v", cache, None)], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 21),
                                              h.make_opsetid("com.microsoft", 1)], ir_version=10)


def timed(batch: int, new: int, past: int, buffer: int, int8: bool, threads: int,
          runs: int) -> float:
    """Seconds per call: ``new`` tokens after ``past`` cached ones, the cache bound in place."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(_model(batch, new, buffer, int8).SerializeToString(),
                                   options, providers=["CPUExecutionProvider"])
    dtype = np.int8 if int8 else np.float32
    caches = [ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, KV_HEADS, buffer, HEAD), dtype))
              for _ in range(2)]
    binding = session.io_binding()
    binding.bind_cpu_input("qkv", np.random.default_rng(0).random(
        (batch, new, (HEADS + 2 * KV_HEADS) * HEAD), np.float32))
    for name, value in zip(("pk", "pv"), caches, strict=True):
        binding.bind_ortvalue_input(name, value)
    for name, value in zip(("k", "v"), caches, strict=True):
        binding.bind_ortvalue_output(name, value)
    binding.bind_cpu_input("seqlens", np.full(batch, past + new - 1, np.int32))
    binding.bind_cpu_input("total", np.array(past + new, np.int32))
    binding.bind_output("o")
    session.run_with_iobinding(binding)  # (warm)
    started = time.perf_counter()
    for _ in range(runs):
        session.run_with_iobinding(binding)
    return (time.perf_counter() - started) / runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--past", default="640,4000")
    parser.add_argument("--prompt", default="512,3584")
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for int8 in (False, True):
        cache = "int8" if int8 else "float32"
        for past in (int(p) for p in args.past.split(",")):
            seconds = timed(1, 1, past, args.max_length, int8, args.threads, 500)
            print(f"decode, {cache} cache, {past} positions: {seconds * 1e6:.1f} us")
        for length in (int(p) for p in args.prompt.split(",")):
            seconds = timed(1, length, 0, args.max_length, int8, args.threads, 3)
            print(f"prompt, {cache} cache, {length} tokens: {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
