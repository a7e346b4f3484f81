"""The current benchmark page (docs/bench.md), made again by one command on the machine it
runs on: attention fused against the exported graph, and a decoder's step in float and int4,
each side by side in one `mha-onnx profile` run (interleaved rounds). The pages with
benchmarks of their own (serving, quantization on trained weights, families, the dated
notebook) are linked with their commands.

    .venv/bin/python tools/bench_page.py --out /tmp/bench --page docs/bench.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = str(ROOT / ".venv" / "bin" / "mha-onnx")
TRAINED = ROOT / "tests" / "fixtures" / "trained" / "llama"
LINKED = [
    ("serve-bench.md", "many users at once: this server (continuous and `--max-batch 1`), ORT "
     "GenAI and llama.cpp's server on the same weights, 1-64 clients"),
    ("serve-bench-decode.md", "the same, decode-heavy requests"),
    ("quantize-trained.md", "quantization methods on the trained fixture: held-out "
     "perplexity, KL, top-1, size"),
    ("families.md", "every family tried, fused and verified, with the commands"),
    ("fusion-forms.md", "the kernel forms per mask kind and how they were chosen"),
    ("history/bench-notebook.md", "the dated lab notebook (2026-11 to 2026-12-06): every "
     "measurement behind a choice, each with its command; not regenerated"),
]


def cli(*args: str) -> str:
    done = subprocess.run([CLI, *args], capture_output=True, text=True, check=True)
    return done.stdout


def attention(out: Path) -> tuple[dict, list[str]]:
    """The base preset with 25% of the keys padded: the export against its fusion."""
    source, fused = out / "base.onnx", out / "base.fused.onnx"
    cli("export", "--preset", "base", "--mask", "key-padding", "-o", str(source), "--force")
    cli("fuse", str(source), "-o", str(fused), "--force")
    args = ["profile", str(source), str(fused), "--batch", "1,8", "--seq-lens",
            "128,512,2048", "--pad-fraction", "0.25", "--min-time", "1", "--no-ops", "--json"]
    report = json.loads(cli(*args))
    return report, ["mha-onnx " + " ".join(a.replace(str(out), "OUT") for a in args)]


def decoder(out: Path) -> tuple[dict, list[str]]:
    """The trained fixture exported (fused by export) and quantized to int4: one decode
    step at 128 cached positions, batch 1 and 8."""
    float_path, int4 = out / "float" / "model.onnx", out / "int4" / "model.onnx"
    cli("export", "--model", str(TRAINED), "-o", str(float_path), "--force")
    cli("quantize", str(float_path), "-o", str(int4), "--force", "--no-sensitivity")
    args = ["profile", str(float_path), str(int4), "--decode", "--context", "128", "--batch",
            "1,8", "--min-time", "1", "--no-ops", "--json"]
    report = json.loads(cli(*args))
    return report, ["mha-onnx " + " ".join(a.replace(str(out), "OUT") for a in args)]


def table(report: dict, key: str) -> list[str]:
    """One row per point: each model's p50 and the second's speedup over the first."""
    models = list(dict.fromkeys(p["model"] for p in report["points"]))
    rows = {}
    for p in report["points"]:
        rows.setdefault((p["batch"], p.get(key) or p["seq_len"]), {})[p["model"]] = p["p50_ms"]
    lines = [f"| batch | {key.replace('_', ' ')} | " + " | ".join(
        f"{Path(m).parent.name}/{Path(m).name} p50 ms" for m in models) + " | ratio |",
        "| --- | --- | " + " | ".join("---" for _ in models) + " | --- |"]
    for (batch, size), times in sorted(rows.items()):
        if len(times) < 2:
            continue
        first, second = (times[m] for m in models[:2])
        lines.append(f"| {batch} | {size} | " + " | ".join(f"{times[m]:.3f}" for m in models)
                     + f" | {first / second:.2f}x |")
    return lines


def page(out: Path) -> str:
    attn, attn_cmds = attention(out)
    dec, dec_cmds = decoder(out)
    machine = attn.get("machine", {})
    said = ", ".join(f"{k} {v}" for k, v in machine.items() if isinstance(v, (str, int)))
    lines = ["# Benchmarks (current)", "",
             f"Made {datetime.date.today()} by `.venv/bin/python tools/bench_page.py --out "
             f"/tmp/bench --page docs/bench.md` on: {said}.", "",
             "## Attention: fused against the exported graph", "",
             "The project's MHA (preset `base`, 25% of the keys padded), the export against "
             "`fuse`'s output in one interleaved run (ratio: the export's p50 over the "
             "fused one's; above 1: fused is faster).", "", "```", *attn_cmds, "```", "",
             *table(attn, "seq_len"), "",
             "## A decoder's step: float32 against int4", "",
             "The trained fixture (`tests/fixtures/trained/llama`, 4 layers, hidden 128) "
             "exported, then `quantize` (int4, block 32): one decode step at 128 cached "
             "positions (ratio: float's p50 over int4's). A model this small is bound by "
             "per-op overhead, not by reading its weights: the 16-layer figures are in the "
             "notebook and the serving pages.", "", "```", *dec_cmds, "```", "",
             *table(dec, "context"), "",
             "## Pages with benchmarks of their own", ""]
    lines += [f"- [{name}]({name}): {what}" for name, what in LINKED]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--page", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    text = page(args.out)
    if args.page:
        args.page.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
