"""`quantize --kv-bits 8` across the Optimum decoder fixtures (tests/fixtures/optimum): each
fused with ``--kv-cache shared``, quantized with and without the int8 cache (int4 weights,
``--no-check``), then generate's tokens for a ragged two-row batch and the report's KL.

    .venv/bin/python -m tools.experiments.kv_families llama mistral qwen3 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from mha_onnx.cli import main as cli
from tests.paths import OPTIMUM

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


def _quantized(fused: Path, out: Path, extra: list[str]) -> dict:
    from mha_onnx.generate import GenerationConfig, Generator

    made = CliRunner().invoke(cli, ["quantize", str(fused), "-o", str(out), "--no-check",
                                    "--no-sensitivity", "--json", *extra])
    if made.exit_code != 0:
        return {"exit": made.exit_code, "error": made.output.strip().splitlines()[-1][:200]}
    report = json.loads(made.output[made.output.index("{"):])
    with Generator(out) as generator:
        tokens = generator.generate(PROMPTS, GenerationConfig(6, eos=())).sequences
    return {"kl_mean": report["accuracy"]["kl_mean"], "tokens": [list(t) for t in tokens]}


def family(name: str, root: Path) -> dict:
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    fused = folder / "float" / "model.onnx"
    fused.parent.mkdir(parents=True)
    for extra in (OPTIMUM / name).glob("*.json"):  # (config.json: the generation settings)
        shutil.copy(extra, fused.parent / extra.name)
    made = CliRunner().invoke(cli, ["fuse", str(OPTIMUM / name / "model.onnx"), "-o",
                                    str(fused), "--kv-cache", "shared"])
    if made.exit_code != 0:
        return {"fuse": made.output.strip().splitlines()[-1][:200]}
    return {"int4": _quantized(fused, folder / "int4" / "model.onnx", []),
            "int4 + int8 cache": _quantized(fused, folder / "kv8" / "model.onnx",
                                            ["--kv-bits", "8"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="+")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kv_families"))
    args = parser.parse_args(argv)
    print("| family | KL int4 | KL int4 + int8 cache | same tokens (ragged batch) |")
    print("|---|---|---|---|")
    for name in args.families:
        got = family(name, args.out)
        if "fuse" in got:
            print(f"| {name} | - | - | not fused with a shared cache: {got['fuse']} |")
            continue
        plain, kv = got["int4"], got["int4 + int8 cache"]
        if "exit" in plain or "exit" in kv:
            print(f"| {name} | - | - | quantize failed: {kv.get('error') or plain.get('error')} |")
            continue
        print(f"| {name} | {plain['kl_mean']:.2e} | {kv['kl_mean']:.2e} | "
              f"{'yes' if plain['tokens'] == kv['tokens'] else 'no: ' + str(kv['tokens'])} |",
              flush=True)


if __name__ == "__main__":
    main()
