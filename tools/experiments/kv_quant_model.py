"""A whole decoder on an int8 KV cache: the file GenAI runs beside a shared-cache fusion
(``model.genai.onnx``: no Ifs, GroupQueryAttention on the shared buffer in every layer)
with each layer's cache made int8 per head and channel (kv_quant.py measured the kernel
alone), the scales calibrated from the float file's own cache on a calibration prompt.

Both files run a ``--context``-token prompt (random ids) and ``--steps`` greedy steps, the
buffers bound in place (past and present one OrtValue, as a generation loop binds them):
the float file free-running; the int8 file once teacher-forced on the float file's tokens
(each step's logits against the float step's: KL divergence and top-1 agreement) and once
free-running (how many tokens it keeps before it departs). Step times: the two files in
turn, ``--rounds`` rounds (median). An experiment, not a form fuse writes.

    .venv/bin/python -m tools.experiments.kv_quant_model /tmp/bench/llama16/q4new/model.genai.onnx \\
        --context 4096 --steps 32 [--int8 /tmp/bench/llama16/kv8/model.genai.onnx]

``--int8``: the file ``quantize --kv-bits 8`` wrote instead of one made here (its own
weights must be MODEL's: the same float fusion quantized the same way).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import onnx


def quantized_cache(model: onnx.ModelProto, scales: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with every GroupQueryAttention's cache int8 per head and channel; ``scales``:
    past name -> [1, kv_heads, 1, head_size]."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    caches = set()
    for node in out.graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        past_k, past_v = node.input[3], node.input[4]
        inputs = list(node.input) + [""] * (12 - len(node.input))
        del node.input[:]
        node.input.extend(inputs[:12] + [f"{past_k}_scale", f"{past_v}_scale"])
        for name in (past_k, past_v):
            out.graph.initializer.append(onnx.numpy_helper.from_array(
                scales[name].astype(np.float32), f"{name}_scale"))
        node.attribute.extend([onnx.helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               onnx.helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                               onnx.helper.make_attribute("kv_cache_bit_width", 8)])
        caches.update([past_k, past_v, node.output[1], node.output[2]])
    for value in (*out.graph.input, *out.graph.output):
        if value.name in caches:
            value.type.tensor_type.elem_type = onnx.TensorProto.INT8
    return out


class Loop:
    """One file's session with its caches bound in place (batch 1)."""

    def __init__(self, model: bytes, folder: Path, capacity: int, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(folder))
        self.session = ort.InferenceSession(model, options)
        self.binding = self.session.io_binding()
        types = {"tensor(float)": np.float32, "tensor(int8)": np.int8,
                 "tensor(float16)": np.float16}
        self.pasts = {}
        for i in self.session.get_inputs():
            if i.name.startswith("past_key_values."):
                shape = (1, i.shape[1], capacity, i.shape[3])
                value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, types[i.type]))
                self.pasts[i.name] = value
                self.binding.bind_ortvalue_input(i.name, value)

    def run(self, ids: list[int], past: int) -> np.ndarray:
        new = len(ids)
        feeds = {"input_ids": np.array([ids], np.int64),
                 "attention_mask": np.ones((1, past + new), np.int64),
                 "position_ids": np.arange(past, past + new, dtype=np.int64)[None]}
        for name, value in feeds.items():
            self.binding.bind_cpu_input(name, value)
        self.binding.clear_binding_outputs()  # (the logits' shape changes from run to run)
        self.binding.bind_output("logits", "cpu")
        for name, value in self.pasts.items():  # each present into its past's buffer
            self.binding.bind_ortvalue_output(name.replace("past_key_values", "present"), value)
        self.session.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[0].numpy()[0, -1]  # (the logits only, not a copy of every cache)

    def caches(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in self.pasts.items()}


def calibrate(loop: Loop, tokens: list[int]) -> dict[str, np.ndarray]:
    loop.run(tokens, 0)
    n = len(tokens)
    return {name: np.maximum(np.abs(cache[:, :, :n]).max(axis=(0, 2), keepdims=True) / 127.0,
                             1e-8) for name, cache in loop.caches().items()}


def generate(loop: Loop, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Greedy tokens (or ``forced``'s), each step's logits and its seconds."""
    logits = [loop.run(prompt, 0)]
    tokens, seconds = [], []
    for i in range(steps):
        token = forced[i] if forced is not None else int(np.argmax(logits[-1]))
        tokens.append(token)
        started = time.perf_counter()
        logits.append(loop.run([token], len(prompt) + i))
        seconds.append(time.perf_counter() - started)
    return tokens, logits[:-1], seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a shared-cache decode file (model.genai.onnx)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--calibration", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--int8", type=Path, default=None,
                        help="the int8-cache file to measure (`quantize --kv-bits 8`'s GenAI "
                             "file beside MODEL's); default: made here from MODEL")
    args = parser.parse_args(argv)
    from mha_onnx.generate import read_interface
    from mha_onnx.quantize.accuracy import kl_top1

    proto = onnx.load(args.model, load_external_data=False)
    vocab = read_interface(proto, args.model).vocab
    rng = np.random.default_rng(0)
    capacity = args.context + args.steps + 1
    folder, plain = args.model.parent, args.model.read_bytes()
    calibration = [int(t) for t in rng.integers(0, vocab, args.calibration)]
    if args.int8 is None:
        scales = calibrate(Loop(plain, folder, args.calibration + 1, args.threads), calibration)
        made = quantized_cache(proto, scales).SerializeToString()
    else:
        made = args.int8.read_bytes()
    made_in = folder if args.int8 is None else args.int8.parent  # (its weights' folder)
    prompt = [int(t) for t in rng.integers(0, vocab, args.context)]
    times: dict[str, list[float]] = {"float32 cache": [], "int8 cache": []}
    for _ in range(args.rounds):
        want, float_logits, seconds = generate(Loop(plain, folder, capacity, args.threads),
                                               prompt, args.steps)
        times["float32 cache"].append(statistics.median(seconds) * 1e3)
        got, _, seconds = generate(Loop(made, made_in, capacity, args.threads), prompt,
                                   args.steps)
        times["int8 cache"].append(statistics.median(seconds) * 1e3)
    _, forced_logits, _ = generate(Loop(made, made_in, capacity, args.threads), prompt,
                                   args.steps, forced=want)
    kls, agree = kl_top1(np.stack(float_logits), np.stack(forced_logits))
    top1 = float(agree.mean())
    kept = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b),
                len(want))
    base = statistics.median(times["float32 cache"])
    print(f"{args.model}: context {args.context}, {args.steps} steps, " + (
        f"calibrated on {args.calibration} tokens" if args.int8 is None else
        f"int8 cache: {args.int8}"))
    print("| cache | step ms (median of rounds) | vs float32 | KL mean | KL max | top-1 | "
          "greedy tokens kept |")
    print("|---|---|---|---|---|---|---|")
    for name, value in times.items():
        step = statistics.median(value)
        figures = ("0", "0", "1.000", f"{len(want)}/{len(want)}") if name.startswith("float") \
            else (f"{np.mean(kls):.2e}", f"{np.max(kls):.2e}", f"{top1:.3f}",
                  f"{kept}/{len(want)}")
        print(f"| {name} | {step:.3f} | {step / base:.2f}x | " + " | ".join(figures) + " |")


if __name__ == "__main__":
    main()
