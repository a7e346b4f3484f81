"""Quantization methods measured on the trained fixture (tests/fixtures/trained/llama), whose
logits are peaked: the file each writes, its held-out perplexity on text the model never saw
(the standard library's last docstrings, as tools/train_fixture.py holds them out), and the
figures `quantize` gates on (KL, top-1, greedy, over its random-id prompts). One table,
written to docs with the command.

    .venv/bin/python tools/quantize_trained.py --out /tmp/qt --page docs/quantize-trained.md \
        [--llama-cpp LLAMA_CPP_SRC]

With --llama-cpp (the ``vendor/llama.cpp`` folder of llama-cpp-python's sdist, as
tools/gguf_anchor.py takes it; ``.venv-optimum`` and ``.venv-llama``), llama.cpp's own
conversion of the folder and its Q4_0 join the table: bytes against llama.cpp's float file,
perplexity on the same held-out windows through llama.cpp (tools/gguf_perplexity.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.train_fixture import docstrings, target_log_probs  # noqa: E402

CLI = str(ROOT / ".venv" / "bin" / "mha-onnx")
VARIANTS = {  # name -> quantize's options
    "int8 RTN": ["--weights", "int8"],
    "w8a8 (int8 weights per column and activations per row)": ["--weights", "w8a8"],
    "int4 RTN, block 32 (default)": [],
    "int4 RTN, block 64": ["--block-size", "64"],
    "int4 RTN, block 128": ["--block-size", "128"],
    "int4 RTN, block 256 asymmetric": ["--block-size", "256", "--asymmetric"],
    "int4 HQQ, block 32": ["--algorithm", "hqq"],
    "int4 RTN, first and last layers int8": ["--mixed", "first-last"],
    "int4 RTN, the embedding int8": ["--embeddings", "int8"],
    "int4 RTN, the embedding int4": ["--embeddings", "int4"],
    "int4 GPTQ, block 32": ["--algorithm", "gptq", "--calibration", "CALIBRATION"],
    "int4 GPTQ, block 128": ["--algorithm", "gptq", "--calibration", "CALIBRATION",
                             "--block-size", "128"],
    "int4 GPTQ, block 64, the LM head int8": ["--algorithm", "gptq", "--calibration",
                                              "CALIBRATION", "--block-size", "64",
                                              "--mixed", "*lm_head*"],
    "int4 GPTQ, block 128, the LM head int8": ["--algorithm", "gptq", "--calibration",
                                               "CALIBRATION", "--block-size", "128",
                                               "--mixed", "*lm_head*"],
    "int4 RTN, block 128, --mixed auto": ["--block-size", "128", "--mixed", "auto"],
    "int4 RTN, --mixed auto under --max-kl 0.02": ["--mixed", "auto", "--max-kl", "0.02"],
}
WINDOW, WINDOWS = 128, 24
EVAL_WINDOWS = 8  # held-out windows after the perplexity's: quantize --eval-prompts
CALIBRATION_WINDOWS = 64  # of the training text, GPTQ's --calibration (CALIBRATION above)


def held_out_windows(folder: Path, first: int, count: int) -> list[list[int]]:
    """``count`` windows of WINDOW held-out tokens, from window ``first`` on."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(docstrings()[1])["input_ids"]
    return [ids[i:i + WINDOW] for i in range(first * WINDOW, (first + count) * WINDOW, WINDOW)]


def decode_step(path: Path, folder: Path, steps: int = 64, rounds: int = 3) -> float:
    """Median ms per generated token at batch 1 after a 128-token held-out prompt
    (generate's loop, 2 threads), the median over ``rounds``."""
    import time

    from mha_onnx.generate import GenerationConfig, Generator

    prompt = held_out_windows(folder, 0, 1)[0]
    medians = []
    with Generator(str(path), threads=2) as generator:
        for _ in range(rounds + 1):  # (the first warms)
            stamps: list[float] = []
            generator.generate([prompt], GenerationConfig(max_new_tokens=steps + 1, eos=()),
                               on_step=lambda done, total, into=stamps: into.append(
                                   time.perf_counter()))
            medians.append(float(np.median(np.diff(stamps))) * 1e3)
    return float(np.median(medians[1:]))


def calibration_windows(folder: Path) -> list[list[int]]:
    """The training text's first CALIBRATION_WINDOWS windows of WINDOW tokens."""
    from transformers import AutoTokenizer

    text = docstrings()[0][:CALIBRATION_WINDOWS * WINDOW * 8]
    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    return [ids[i:i + WINDOW] for i in range(0, CALIBRATION_WINDOWS * WINDOW, WINDOW)]


def held_out_perplexity(path: Path, folder: Path) -> float:
    """exp(mean next-token cross-entropy) over WINDOWS windows of held-out text."""
    import onnx

    from mha_onnx.quantize import kv_cache
    from mha_onnx.quantize.feeds import decoder_feeds, session_outputs

    windows = held_out_windows(folder, 0, WINDOWS)
    model = onnx.load(path, load_external_data=False)
    feeds, _ = decoder_feeds(model, str(path), len(windows), WINDOW, seed=0)
    feeds["input_ids"] = np.array(windows, feeds["input_ids"].dtype)
    logits = session_outputs(str(path), kv_cache.cache_feeds(model, feeds))["logits"]
    chosen = target_log_probs(logits[:, :-1], np.array(windows)[:, 1:])
    return math.exp(-float(chosen.mean()))


def run(args: argparse.Namespace) -> list[dict]:
    float_path = args.out / "float" / "model.onnx"
    subprocess.run([CLI, "export", "--model", str(args.folder), "-o", str(float_path),
                    "--force"], check=True, capture_output=True)
    rows = [{"name": "float32", "ratio": 1.0,
             "perplexity": held_out_perplexity(float_path, args.folder),
             "step": decode_step(float_path, args.folder)}]
    text = args.out / "eval-prompts.json"
    text.write_text(json.dumps(held_out_windows(args.folder, WINDOWS, EVAL_WINDOWS)))
    calibration = args.out / "calibration.json"
    calibration.write_text(json.dumps(calibration_windows(args.folder)))
    for name, options in VARIANTS.items():
        options = [str(calibration) if o == "CALIBRATION" else o for o in options]
        path = args.out / name.split(",")[0].replace(" ", "-") / f"{len(rows)}.onnx"
        figures, report = _quantized(float_path, path, options)
        perplexity = held_out_perplexity(path, args.folder)
        step = decode_step(path, args.folder)
        on_text, _ = _quantized(float_path, path, [*options, "--eval-prompts", str(text)])
        rows.append({"name": name, "ratio": report["bytes"]["quantized"]
                     / report["bytes"]["float"], "perplexity": perplexity,
                     "kl": figures["kl_mean"], "top1": figures["top1"],
                     "greedy": figures["greedy"], "gate": _verdict(figures),
                     "text_kl": on_text["kl_mean"], "text_gate": _verdict(on_text),
                     "kept": _kept(report), "step": step})
    return rows


def llama_cpp_rows(args: argparse.Namespace) -> list[dict]:
    """llama.cpp's conversion of the folder (float32) and its Q4_0 (tools/gguf_anchor.py),
    the held-out perplexity of each through llama.cpp itself (tools/gguf_perplexity.py)."""
    if args.llama_cpp is None:
        return []
    out = args.out / "gguf" / "q4_0.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(ROOT / ".venv-optimum" / "bin" / "python"), "-m", "tools.gguf_anchor",
                    str(args.llama_cpp), str(args.folder), str(out)], cwd=ROOT, check=True,
                   capture_output=True)
    windows = args.out / "held-out.json"
    windows.write_text(json.dumps(held_out_windows(args.folder, 0, WINDOWS)))
    floated = out.with_name("q4_0-f32.gguf")
    rows = []
    for name, path in (("llama.cpp float32 (its GGUF conversion)", floated),
                       ("llama.cpp Q4_0 (its quantizer's default for Q4_0)", out)):
        done = subprocess.run([str(ROOT / ".venv-llama" / "bin" / "python"), "-m",
                               "tools.gguf_perplexity", str(path), str(windows)], cwd=ROOT,
                              check=True, capture_output=True, text=True)
        rows.append({"name": name, "ratio": path.stat().st_size / floated.stat().st_size,
                     "perplexity": json.loads(done.stdout.splitlines()[-1])["perplexity"]})
    return rows


def _quantized(source: Path, path: Path, options: list[str]) -> tuple[dict, dict]:
    """`quantize`'s accuracy figures and report for ``options`` (written either way, but
    by --mixed auto, which writes what passes)."""
    check = [] if "auto" in options else ["--no-check"]
    done = subprocess.run([CLI, "quantize", str(source), "-o", str(path), "--force",
                           *check, "--no-sensitivity", "--json", *options],
                          capture_output=True, text=True)
    report = json.loads(done.stdout)
    return report["accuracy"], report


def _kept(report: dict) -> str | None:
    """What --mixed auto kept wider (N - 1 measured failing), or None."""
    chosen = [t for t in report.get("mixed_auto", []) if t["passed"] and t["kept"]]
    if not chosen:
        return None
    least = min(chosen, key=lambda t: t["kept"])
    return f"{least['kept']} most sensitive weight(s) kept in {least['form']}"


def _verdict(figures: dict) -> str:
    return "passes" if figures["passed"] else "fails: " + "; ".join(figures["failures"])[:80]


def page(rows: list[dict], folder: Path, llama_cpp: Path | None = None) -> str:
    from mha_onnx.runtime.machine import machine_info

    record = json.loads((folder / "training.json").read_text())
    machine = machine_info()
    lines = [
        "# Quantization on trained weights", "",
        f"Measured {datetime.date.today()} on {machine['processor']} ({machine['isa']}, "
        f"{machine['cpus']} cpus), onnxruntime {machine['onnxruntime']}'s quantizer; the model: "
        f"`{folder.relative_to(ROOT)}` (tools/train_fixture.py: "
        f"{record['tokens']['train']:,} tokens of the standard library's docstrings, "
        f"held-out perplexity {record['held_out_perplexity']} against a uniform "
        f"{record['uniform_perplexity']}).", "",
        "```", ".venv/bin/python tools/quantize_trained.py --out /tmp/qt "
        "--page docs/quantize-trained.md" + (f" --llama-cpp {llama_cpp}" if llama_cpp else ""),
        "```", "",
        f"Held-out perplexity: the held-out text in {WINDOWS} windows of {WINDOW} tokens. KL, "
        "top-1 and greedy: what `quantize` gates on by default (its 4 random-id prompts of 64 "
        "tokens, against the float model); the gate: its defaults (KL <= 0.05, top-1 >= 0.80, "
        f"cosine >= 0.95). On held-out text: the same gate with `--eval-prompts` the next "
        f"{EVAL_WINDOWS} held-out windows of {WINDOW} tokens. Decode: ms per token at batch "
        "1 after a 128-token prompt (generate's loop, 2 threads, median of 3 runs of 64): a "
        "model this small steps in fractions of a millisecond, mostly the loop's own cost; "
        "the 16-layer model's steps are in docs/guide/serve.md. GPTQ's `--calibration`: the "
        f"training text's first {CALIBRATION_WINDOWS} windows of {WINDOW} tokens (none of "
        "the held-out text)." + (" llama.cpp rows: its own conversion and quantizer "
                                  "(tools/gguf_anchor.py), bytes against its float GGUF, "
                                  "perplexity through llama.cpp on the same windows."
                                  if llama_cpp else ""), "",
        "| weights | bytes (x float) | held-out perplexity | KL (nats) | top-1 | greedy | "
        "default gate | KL on held-out text | gate on held-out text | decode ms/token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = [f"- {row['name']}: the {row['kept']} (one fewer was measured failing the "
             "gate)" for row in rows if row.get("kept")]
    for row in rows:
        cells = [row["name"], f"{row['ratio']:.2f}x", f"{row['perplexity']:.2f}"]
        cells += [f"{row[k]:.4f}" if row.get(k) is not None else "-"
                  for k in ("kl", "top1", "greedy")] + [row.get("gate", "-")]
        cells += [f"{row['text_kl']:.4f}" if row.get("text_kl") is not None else "-",
                  row.get("text_gate", "-"),
                  f"{row['step']:.3f}" if row.get("step") is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "`--mixed auto` rows (the gate's run and the held-out text's each search "
                  "on their own prompts; the perplexity is the first's file):", *notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=ROOT / "tests/fixtures/trained/llama")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--page", type=Path)
    parser.add_argument("--llama-cpp", type=Path, default=None, metavar="SRC",
                        help="llama-cpp-python's vendor/llama.cpp (tools/gguf_anchor.py): "
                             "rows for llama.cpp's float and Q4_0 conversions too")
    args = parser.parse_args()
    args.folder = args.folder.resolve()
    text = page(run(args) + llama_cpp_rows(args), args.folder, args.llama_cpp)
    if args.page:
        args.page.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
