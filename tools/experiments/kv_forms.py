"""Which of ONNX Runtime's cached-attention forms is fastest for one decode step?

    .venv/bin/python -m tools.experiments.kv_forms [--context 1024,4096] [--batch 1] [--kv-heads 8]

One new token against a cache of ``context`` positions (base preset sizes: 8 heads of 64),
its presents returned as the model's outputs (the KV-cache interface), three ways:

- concat + MHA: the graph's Concat makes the presents, MultiHeadAttention reads them (what
  fuse made of a step before it routed the presents);
- MHA with past: MultiHeadAttention takes past_key/past_value and returns the presents
  (needs as many K/V heads as query heads);
- GQA with past: GroupQueryAttention likewise (seqlens_k, total_sequence_length computed in
  the graph), with ``kv_num_heads``;
- GQA shared buffer: GroupQueryAttention on a max-length cache buffer (``--max-length``)
  bound with IO binding as both past and present, so a step writes one position in place
  (ORT's past/present buffer sharing; seqlens_k and total_sequence_length are inputs). This
  changes the model's interface: the caller owns the buffer and the lengths.

All outputs (and the presents: the shared buffer's first context + 1 positions) are checked
against the first form's. Sessions timed in turn (2 threads, idle pools sleeping), medians
of ``--repeats`` rounds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from onnx import TensorProto as TP
from onnx import helper

from mha_onnx.graph.cache import bound_step, shared_buffers
from mha_onnx.runtime.ort import OrtRunner

HEADS, DK = 8, 64
MS = "com.microsoft"


def _graph(form: str, batch: int, kv_heads: int):
    hidden, kv_hidden = HEADS * DK, kv_heads * DK
    inputs = [helper.make_tensor_value_info("q", TP.FLOAT, [batch, 1, hidden])] + [
        helper.make_tensor_value_info(n, TP.FLOAT, [batch, 1, kv_hidden]) for n in ("k", "v")] + [
        helper.make_tensor_value_info(n, TP.FLOAT, [batch, kv_heads, "past", DK])
        for n in ("past_key", "past_value")]
    outputs = [helper.make_tensor_value_info(n, TP.FLOAT, None)
               for n in ("out", "present_key", "present_value")]
    make = helper.make_node
    if form == "concat + MHA":
        shape = helper.make_tensor("shape", TP.INT64, [4], [batch, 1, kv_heads, DK])
        nodes = [make("Constant", [], ["shape"], value=shape)]
        for x in ("k", "v"):
            nodes += [make("Reshape", [x, "shape"], [x + "4"]),
                      make("Transpose", [x + "4"], [x + "t"], perm=[0, 2, 1, 3]),
                      make("Concat", [f"past_{'key' if x == 'k' else 'value'}", x + "t"],
                           [f"present_{'key' if x == 'k' else 'value'}"], axis=2)]
        nodes.append(make("MultiHeadAttention", ["q", "present_key", "present_value"], ["out"],
                          domain=MS, num_heads=HEADS))
    elif form == "MHA with past":
        nodes = [make("MultiHeadAttention", ["q", "k", "v", "", "", "", "past_key", "past_value"],
                      ["out", "present_key", "present_value"], domain=MS, num_heads=HEADS)]
    elif form == "GQA shared buffer":
        inputs += [helper.make_tensor_value_info("seqlens", TP.INT32, [batch]),
                   helper.make_tensor_value_info("total", TP.INT32, [])]
        nodes = [make("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens",
                                              "total"], ["out", "present_key", "present_value"],
                      domain=MS, num_heads=HEADS, kv_num_heads=kv_heads)]
    else:
        one = helper.make_tensor("one", TP.INT32, [1], [1])
        nodes = [make("Shape", ["past_key"], ["p64"], start=2, end=3),
                 make("Cast", ["p64"], ["p"], to=TP.INT32),
                 make("Constant", [], ["one"], value=one),
                 make("Add", ["p", "one"], ["t1"]),
                 make("Constant", [], ["scalar"], value=helper.make_tensor("s", TP.INT64, [0], [])),
                 make("Reshape", ["t1", "scalar"], ["total"]),
                 make("Expand", ["p", "batch"], ["seqlens"]),
                 make("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens",
                                              "total"], ["out", "present_key", "present_value"],
                      domain=MS, num_heads=HEADS, kv_num_heads=kv_heads)]
        nodes.insert(0, make("Constant", [], ["batch"],
                             value=helper.make_tensor("b", TP.INT64, [1], [batch])))
    graph = helper.make_graph(nodes, form, inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid(MS, 1)], ir_version=10)


def _session(form: str, batch: int, kv_heads: int, threads: int):
    """Idle pool threads sleep: the forms are timed in turn in one process."""
    model = _graph(form, batch, kv_heads).SerializeToString()
    return OrtRunner(model, threads=threads, spinning=False).session


class _Shared:
    """One step on a max-length cache buffer that is both past and present (IO binding,
    as ``mha_onnx.graph.cache`` binds a ``--kv-cache shared`` model)."""

    def __init__(self, session, feeds: dict, context: int, max_length: int):
        batch = feeds["past_key"].shape[0]
        pairs = {"past_key": "present_key", "past_value": "present_value"}
        self.buffers = shared_buffers({n: feeds[n] for n in pairs}, max_length)
        step = {**feeds, "seqlens": np.full(batch, context, np.int32),
                "total": np.array(context + 1, np.int32)}
        self.binding, self.run_step = bound_step(session, step, self.buffers, pairs)
        self.context = context

    def run(self) -> list[np.ndarray]:
        """A timed step: the output comes back; the cache stays where it is."""
        self.run_step()
        return [self.binding.get_outputs()[0].numpy()]

    def checked(self) -> list[np.ndarray]:
        """A step's output and the buffers' first context + 1 positions (the presents)."""
        end = self.context + 1
        return self.run() + [self.buffers[n].numpy()[:, :, :end]
                             for n in ("past_key", "past_value")]


def measure(context: int, batch: int, kv_heads: int, threads: int, repeats: int,
            max_length: int = 0) -> dict:
    forms = ["GQA with past"] + (["concat + MHA", "MHA with past"] if kv_heads == HEADS else [])
    forms.sort(key=lambda f: f != "concat + MHA")
    if max_length > context:
        forms.append("GQA shared buffer")
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((batch, 1, HEADS * DK), np.float32)}
    for name in ("k", "v"):
        feeds[name] = rng.standard_normal((batch, 1, kv_heads * DK), np.float32)
    for name in ("past_key", "past_value"):
        feeds[name] = rng.standard_normal((batch, kv_heads, context, DK), np.float32)
    steps, checks = {}, {}
    for form in forms:
        session = _session(form, batch, kv_heads, threads)
        if form == "GQA shared buffer":
            shared = _Shared(session, feeds, context, max_length)
            steps[form], checks[form] = shared.run, shared.checked
        else:
            steps[form] = checks[form] = lambda s=session: s.run(None, feeds)
    want = checks[forms[0]]()
    for form, check in checks.items():
        got = check()
        assert len(got) == len(want) == 3, form
        worst = max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))
        assert worst < 1e-4, (form, worst)
    times: dict[str, list[float]] = {f: [] for f in forms}
    for _ in range(repeats):
        for form, step in steps.items():
            start = time.perf_counter()
            step()
            times[form].append(time.perf_counter() - start)
    return {f: float(np.median(t)) * 1e3 for f, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default="1024,4096")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--kv-heads", type=int, default=HEADS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=0,
                        help="also time a shared buffer of this many positions (> context)")
    args = parser.parse_args()
    print("| batch | context | kv heads | form | step ms (median) | vs first |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            ms = measure(context, batch, args.kv_heads, args.threads, args.repeats,
                         args.max_length)
            first = next(iter(ms.values()))
            for form, value in ms.items():
                print(f"| {batch} | {context} | {args.kv_heads} | {form} | {value:.3f} | "
                      f"{value / first:.2f} |")


if __name__ == "__main__":
    main()
