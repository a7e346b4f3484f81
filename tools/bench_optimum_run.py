"""`python -m tools.bench_optimum run DIR`: the graphs built, checked and timed (see
tools/bench_optimum.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mha_onnx.graph.cache import LENGTH_INPUT
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.runtime.ort import OrtRunner
from tools import suite

KV, D = 4, 64
SHARED = FormPolicy(kv_cache="shared")
HEADROOM = 8


def _graphs(folder: Path, reuse: bool = False) -> dict[str, Path]:
    """The graphs to time; the ones this project and ORT's optimizer write are made anew
    unless ``reuse`` (a run after a change of the code must not time an earlier run's)."""
    from mha_onnx.rewrite import fuse_file

    original = folder / "optimum" / "model.onnx"
    out = {"Optimum export": original}
    fused, shared = folder / "fused.onnx", folder / "fused.shared.onnx"
    last = folder / "fused.shared.last.onnx"
    made = [fused, shared, last, folder / "export.onnx", folder / "export.shared.onnx",
            folder / "ort_optimizer.onnx"]
    for path in [] if reuse else made:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".data").unlink(missing_ok=True)
    if not fused.exists():
        print(fuse_file(original, fused).render(), flush=True)
    if not shared.exists():
        print(fuse_file(original, shared, policy=SHARED).render(), flush=True)
    if not last.exists():
        print(fuse_file(original, last, policy=SHARED, logits="last").render(), flush=True)
    out["mha-onnx fuse (appended cache)"] = fused
    out["mha-onnx fuse --kv-cache shared"] = shared
    out["mha-onnx fuse --kv-cache shared --logits last"] = last
    for form, name in (("appended", "export.onnx"), ("shared", "export.shared.onnx")):
        path = folder / name  # the same folder exported by mha-onnx itself (transformers 5)
        if not path.exists():
            from mha_onnx.export.hf import HfExportConfig, export_hf

            print(export_hf(folder / "hf", path, HfExportConfig(kv_cache=form)).render(),
                  flush=True)
        out[f"mha-onnx export --model ({form} cache)"] = path
    ort_opt = folder / "ort_optimizer.onnx"
    if not ort_opt.exists():
        from onnxruntime.transformers.optimizer import optimize_model

        optimize_model(str(original), model_type="gpt2", num_heads=16, hidden_size=1024,
                       opt_level=1).save_model_to_file(str(ort_opt))
    out["ORT transformers optimizer (gpt2, O1)"] = ort_opt
    out["ORT GenAI builder"] = folder / "genai" / "model.onnx"
    # the same two graphs again, each in a session of its own: how far two sessions of one
    # graph read apart in this run (8 % at a batch-8 decode step in docs/history/bench-notebook.md)
    out[f"Optimum export {AGAIN}"] = original
    out[f"ORT GenAI builder {AGAIN}"] = out["ORT GenAI builder"]
    return out


AGAIN = "(again: a second session)"


def left_padding(batch: int, total: int, fraction: float) -> np.ndarray:
    """int64 [batch, total] attention_mask: row b's first ``fraction * b / batch`` of the
    positions padded (row 0 none), as a generation loop left-pads a batch of prompts."""
    mask = np.ones((batch, total), np.int64)
    for b in range(batch):
        mask[b, :int(fraction * total * b / batch)] = 0
    return mask


def _feeds(kind: str, names: list[str], batch: int, new: int, past: int,
           rng: np.random.Generator, left_pad: float = 0.0
           ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(plain inputs, cache buffers) for one step of ``new`` tokens after ``past`` cached
    positions, rows left-padded by up to ``left_pad`` of their length. kinds: appended |
    shared (ours) | genai; the last two hold each row's kept positions first (per-row
    lengths, seqlens_k = kept - 1), the appended cache holds them where the mask has them."""
    from mha_onnx.graph.cache import kept_first

    total = past + new
    mask = left_padding(batch, total, left_pad)
    feeds = {"input_ids": rng.integers(3, 500, (batch, new)).astype(np.int64),
             "attention_mask": mask}
    if "position_ids" in names:  # as Hugging Face counts them: kept positions before
        feeds["position_ids"] = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
    pasts = {}
    length = past if kind == "appended" else total + HEADROOM
    for name in sorted(n for n in names if n.startswith("past_key_values")):  # same per name
        logical = (rng.standard_normal((batch, KV, past, D)) * 0.5).astype(np.float32)
        if kind != "appended":
            logical = kept_first(logical, mask[:, :past] != 0)
        buf = np.zeros((batch, KV, length, D), np.float32)
        buf[:, :, :past] = logical
        pasts[name] = buf
    if kind == "shared" and LENGTH_INPUT in names:  # (made before the shapes carried it)
        feeds[LENGTH_INPUT] = np.array(past, np.int64)
    return feeds, pasts


def _kind(label: str) -> str:
    return "genai" if "GenAI" in label else "shared" if "shared" in label else "appended"


def _step(runner: OrtRunner, kind: str, feeds, pasts) -> tuple[Callable[[], None], Callable]:
    """A run with every input bound once (IO binding); shared buffers also bound as the
    presents, written in place. Returns (run, logits)."""
    import onnxruntime as ort

    session = runner.session
    binding = session.io_binding()
    values = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in
              {**feeds, **pasts}.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for output in session.get_outputs():
        past = output.name.replace("present", "past_key_values")
        if kind != "appended" and past in values:
            binding.bind_ortvalue_output(output.name, values[past])
        else:
            binding.bind_output(output.name, "cpu")

    def logits() -> np.ndarray:  # at the positions the mask keeps (others are never read)
        names = [o.name for o in session.get_outputs()]
        out = binding.copy_outputs_to_cpu()[names.index("logits")]
        kept = feeds["attention_mask"][:, -out.shape[1]:, None] != 0
        return np.where(kept, out, 0.0)

    return (lambda: session.run_with_iobinding(binding)), logits


def _time(runs: dict[str, Callable[[], None]], min_time: float) -> dict[str, float]:
    """Median ms of each run, taken in turn for >= min_time each (profile's timed_loop: one
    of each per round, each round starting one run later)."""
    from mha_onnx.profile.worker import timed_loop

    labels = list(runs)
    times = timed_loop([runs[k] for k in labels], warmup=1, iters=5, min_time=min_time)
    return {k: 1e3 * float(np.median(t)) for k, t in zip(labels, times, strict=True)}


def op_shares(graphs: dict[str, Path], args) -> None:
    """Each graph under ORT's profiler, for the prompt and for a decode step: kernels run
    per call and the share of kernel time per op type (an If's branches counted, not it)."""
    import tempfile
    from collections import Counter

    from mha_onnx.runtime.ort import read_profile

    runs = 5
    for phase, new, past in (("prompt", args.prompt, 0), ("decode", 1, args.context)):
        for label, path in graphs.items():
            if AGAIN in label:  # (the same kernels)
                continue
            with tempfile.TemporaryDirectory() as folder:
                runner = OrtRunner(path, threads=args.threads, spinning=False,
                                   profile_dir=folder)
                feeds, pasts = _feeds(_kind(label), runner.input_names, args.batch, new, past,
                                      np.random.default_rng(0), args.left_pad)
                step, _ = _step(runner, _kind(label), feeds, pasts)
                for _ in range(runs):  # (each call runs the same kernels)
                    step()
                events = [e for e in read_profile(runner.end_profiling()) if e.op_type != "If"]
            times: Counter = Counter()
            for event in events:
                times[event.op_type] += event.micros
            total = sum(times.values())
            shares = ", ".join(f"{op} {100 * t / total:.0f} %" for op, t in times.most_common(3))
            print(f"{phase}, {label}: {len(events) / runs:.0f} kernels per call; {shares}",
                  flush=True)


def run(args, command: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    folder = Path(args.folder)
    graphs = _graphs(folder, args.reuse)
    if args.op_shares:
        op_shares(graphs, args)
        return
    runners = {k: OrtRunner(v, threads=args.threads, spinning=False) for k, v in graphs.items()}
    rows = {}
    for phase, new, past in (("prompt", args.prompt, 0), ("decode", 1, args.context)):
        runs, logits = {}, {}
        # (the order sessions and buffers are made in: two graphs made one after the other
        # have read up to 9 % apart by that order alone here; `--reverse` swaps it)
        for label, runner in (reversed(runners.items()) if args.reverse else runners.items()):
            names = runner.input_names
            feeds, pasts = _feeds(_kind(label), names, args.batch, new, past,
                                  np.random.default_rng(0), args.left_pad)
            runs[label], logits[label] = _step(runner, _kind(label), feeds, pasts)
        base = "Optimum export"
        runs[base]()
        want = logits[base]()
        for label in runs:
            runs[label]()
            got = logits[label]()  # (--logits last: the last position only)
            err = float(np.abs(got - want[:, want.shape[1] - got.shape[1]:]).max())
            print(f"{phase}: {label}: logits max abs vs the export {err:.2e}", flush=True)
        rows[phase] = _time(runs, args.min_time)
    padded = f", rows left-padded by up to {args.left_pad:.0%}" if args.left_pad else ""
    lines = [suite.measured(command, f"batch {args.batch}{padded}, {args.threads} threads, "
                            "fp32, every graph timed in turn in one process, sleeping thread "
                            "pools" + (", sessions made in the reverse order of the table"
                                       if args.reverse else "")), "",
             f"| graph | prompt {args.prompt} tokens ms | ratio | decode step, context "
             f"{args.context} ms | ratio |", "|---|---|---|---|---|"]
    for label in graphs:
        p, d = rows["prompt"][label], rows["decode"][label]
        lines.append(f"| {label} | {p:.1f} | {p / rows['prompt']['Optimum export']:.2f}x | "
                     f"{d:.2f} | {d / rows['decode']['Optimum export']:.2f}x |")
    suite.emit(["", *lines], args.out)
