"""Export -> fuse -> validate matrix across providers, in one process (one torch import).

    python -m tools.gpu_matrix RESULTS_DIR [--providers cpu,cuda] [--presets base,big]

For each preset x dtype x mask: export, fuse (ORT target), validate the unfused export against
its PyTorch reference and the fused model against the unfused one and PyTorch, on every
provider. Writes matrix.json and matrix.md to RESULTS_DIR; exit 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from mha_onnx.config import load_preset
from mha_onnx.errors import MhaOnnxError
from mha_onnx.export.mha import export_model
from mha_onnx.parity import ValidateConfig, validate_model
from mha_onnx.rewrite import fuse_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--providers", default="cpu,cuda")
    parser.add_argument("--presets", default="base,big")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--masks", default="none,key-padding,causal")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.results)
    models = out / "models"
    models.mkdir(parents=True, exist_ok=True)
    providers = tuple(args.providers.split(","))
    rows, ok = [], True
    for preset in args.presets.split(","):
        for dtype in args.dtypes.split(","):
            for mask in args.masks.split(","):
                name = f"{preset}-{dtype}-{mask}"
                start = time.perf_counter()
                row = {"model": name}
                try:
                    cfg = load_preset(preset).replace(dtype=dtype, mask=mask)
                    unfused = models / f"{name}.onnx"
                    fused = models / f"{name}.fused.onnx"
                    export_model(cfg, unfused, force=True)
                    report = fuse_file(unfused, fused, force=True)
                    row["form"] = ", ".join(b.form for b in report.blocks)
                    for label, path, ref in (("unfused", unfused, None), ("fused", fused, str(unfused))):
                        result = validate_model(path, ValidateConfig(providers=providers, reference=ref))
                        row[label] = {
                            "passed": bool(result),
                            "providers": {p.provider: (p.ran, p.reason, list(p.cpu_nodes))
                                          for p in result.providers},
                            "worst": {f"{c.provider} vs {c.against}": 0.0 for c in result.comparisons},
                            "masked": [m.behaviour for m in result.masked_rows][:1],
                        }
                        for c in result.comparisons:
                            key = f"{c.provider} vs {c.against}"
                            row[label]["worst"][key] = max(row[label]["worst"][key], c.stats.max_abs)
                        ok &= bool(result)
                except MhaOnnxError as exc:
                    row["error"] = str(exc)
                    ok = False
                row["seconds"] = round(time.perf_counter() - start, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "matrix.json").write_text(json.dumps(rows, indent=2))
    lines = ["| model | fused form | unfused: worst max abs | fused: worst max abs | passed |",
             "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | error: {row['error']} | | | no |")
            continue
        cells = []
        for label in ("unfused", "fused"):
            cells.append("; ".join(f"{k} {v:.1e}" for k, v in sorted(row[label]["worst"].items())))
        passed = row["unfused"]["passed"] and row["fused"]["passed"]
        lines.append(f"| {row['model']} | {row['form']} | {cells[0]} | {cells[1]} | {'yes' if passed else 'NO'} |")
    (out / "matrix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
