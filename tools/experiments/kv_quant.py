"""ONNX Runtime's CPU GroupQueryAttention on a quantized, shared KV cache (issue 41's
stretch item): what a decode step costs and how far its output moves, before any fusion
writes the form.

One GroupQueryAttention node on a shared buffer (past and present one tensor, as
``fuse --kv-cache shared`` writes them) in four cache forms: float32, int8 with one scale
(``PER_TENSOR``), int8 and 4-bit with a scale per head and channel (``PER_CHANNEL``; 4-bit
packs two values in a uint8). The scales are static (initializers), calibrated as a
fusion would from a float run: the largest magnitude of the prompt's keys / values (over
the tensor, or per head and channel) over the largest code (127, 7). Keys carry outlier
channels (a few channels 8x the rest, as rotary models' keys have), values do not.

A ``ctx``-token prompt fills each buffer (the kernel quantizes what it writes), then one
step is timed ``--steps`` times in a row, the forms in turn, ``--rounds`` rounds (the
median reported); its output is compared with the float32 cache's.

    .venv/bin/python -m tools.experiments.kv_quant --contexts 1024,4096,8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

FORMS = {  # name: (cache dtype, bits, quant type)
    "float32": (TensorProto.FLOAT, 32, "NONE"),
    "int8, one scale": (TensorProto.INT8, 8, "PER_TENSOR"),
    "int8, per channel": (TensorProto.INT8, 8, "PER_CHANNEL"),
    "int4, per channel": (TensorProto.UINT8, 4, "PER_CHANNEL"),
}


def gqa_model(form: str, heads: int, kv_heads: int, head: int, scales) -> onnx.ModelProto:
    cache, bits, quant = FORMS[form]
    width = head // 2 if bits == 4 else head
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads}
    inputs = ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"]
    inits = []
    if quant != "NONE":
        attrs |= {"k_quant_type": quant, "v_quant_type": quant, "kv_cache_bit_width": bits}
        inputs += ["", "", "", "", "", "k_scale", "v_scale"]  # (cos, sin, positions, bias, sink)
        inits = [onnx.numpy_helper.from_array(s.astype(np.float32), name)
                 for s, name in zip(scales, ("k_scale", "v_scale"), strict=True)]
    node = helper.make_node("GroupQueryAttention", inputs, ["out", "present_key", "present_value"],
                            domain="com.microsoft", **attrs)
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    graph = helper.make_graph([node], "gqa", [
        helper.make_tensor_value_info("q", f32, [1, "S", heads * head]),
        helper.make_tensor_value_info("k", f32, [1, "S", kv_heads * head]),
        helper.make_tensor_value_info("v", f32, [1, "S", kv_heads * head]),
        helper.make_tensor_value_info("past_key", cache, [1, kv_heads, "C", width]),
        helper.make_tensor_value_info("past_value", cache, [1, kv_heads, "C", width]),
        helper.make_tensor_value_info("seqlens_k", i32, [1]),
        helper.make_tensor_value_info("total", i32, [])], [
        helper.make_tensor_value_info("out", f32, None),
        helper.make_tensor_value_info("present_key", cache, None),
        helper.make_tensor_value_info("present_value", cache, None)], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def scales_of(form: str, k: np.ndarray, v: np.ndarray, kv_heads: int, head: int):
    """Static scales from the float prompt's keys and values ([1, T, kv_heads * head])."""
    _, bits, quant = FORMS[form]
    top = 127.0 if bits == 8 else 7.0
    if quant == "PER_TENSOR":
        return [np.array([np.abs(x).max() / top]) for x in (k, v)]
    per = [np.abs(x.reshape(-1, kv_heads, head)).max(axis=0) / top for x in (k, v)]
    return [p.reshape(1, kv_heads, 1, head) for p in per]


def data(ctx: int, heads: int, kv_heads: int, head: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    outliers = np.ones(kv_heads * head, np.float32)
    outliers[rng.choice(kv_heads * head, max(1, kv_heads * head // 32), replace=False)] = 8.0
    q = rng.standard_normal((1, ctx + 1, heads * head), np.float32)
    k = rng.standard_normal((1, ctx + 1, kv_heads * head), np.float32) * outliers
    v = rng.standard_normal((1, ctx + 1, kv_heads * head), np.float32)
    return q, k, v


def measure(ctx: int, args) -> dict[str, tuple[list[float], float, float]]:
    import onnxruntime as ort

    heads, kv_heads, head = args.heads, args.kv_heads, args.head_size
    q, k, v = data(ctx, heads, kv_heads, head)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    made, outs = {}, {}
    for form, (_, bits, _) in FORMS.items():
        model = gqa_model(form, heads, kv_heads, head, scales_of(form, k[:, :ctx], v[:, :ctx],
                                                                 kv_heads, head))
        session = ort.InferenceSession(model.SerializeToString(), options)
        dtype = {TensorProto.FLOAT: np.float32, TensorProto.INT8: np.int8,
                 TensorProto.UINT8: np.uint8}[FORMS[form][0]]
        width = head // 2 if bits == 4 else head
        empty = np.zeros((1, kv_heads, ctx + 8, width), dtype)
        _, pk, pv = session.run(None, {"q": q[:, :ctx], "k": k[:, :ctx], "v": v[:, :ctx],
                                       "past_key": empty, "past_value": empty.copy(),
                                       "seqlens_k": np.array([ctx - 1], np.int32),
                                       "total": np.array(ctx, np.int32)})
        feeds = {"q": q[:, ctx:], "k": k[:, ctx:], "v": v[:, ctx:], "past_key": pk,
                 "past_value": pv, "seqlens_k": np.array([ctx], np.int32),
                 "total": np.array(ctx + 1, np.int32)}
        outs[form] = session.run(["out"], feeds)[0]
        made[form] = (session, feeds, pk.nbytes + pv.nbytes)
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(args.rounds):
        for form, (session, feeds, _) in made.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                session.run(["out"], feeds)
            times[form].append((time.perf_counter() - started) / args.steps * 1e3)
    want = outs["float32"].ravel().astype(np.float64)
    result = {}
    for form in FORMS:
        got = outs[form].ravel().astype(np.float64)
        cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
        result[form] = (times[form], float(np.abs(got - want).max()), cosine, made[form][2])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print("| context | cache | cache MB | step ms (median) | vs float32 | output max abs error "
          "| output cosine |")
    print("|---|---|---|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        result = measure(ctx, args)
        base = statistics.median(result["float32"][0])
        for form, (times, err, cosine, nbytes) in result.items():
            step = statistics.median(times)
            print(f"| {ctx} | {form} | {nbytes / 2**20:.2f} | {step:.3f} | {step / base:.2f}x "
                  f"| {err:.2e} | {cosine:.6f} |")


if __name__ == "__main__":
    main()
