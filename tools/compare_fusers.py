"""Coverage and parity of three attention fusers over the same generated graphs:
mha-onnx's ``fuse``, onnxscript's ``optimize_for_ort`` and ONNX Runtime's transformers
optimizer (``onnxruntime.transformers.optimizer.optimize_model``).

    .venv/bin/python -m tools.compare_fusers [--out docs/fusers.md] [NAME ...]

For each graph (this project's exports and tests/models.py's foreign ones): attention blocks in
the original, how many each fuser left unfused, whether its output runs on ORT CPU, and its
max abs error against the original at untraced shapes (masks with padding, a fully padded
batch entry; NaN where the original has NaN counts as equal).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import logging
import sys
import warnings
from pathlib import Path

import onnx
import onnx_ir as ir

from mha_onnx.config import MhaConfig
from mha_onnx.errors import MhaOnnxError
from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.blocks import find_blocks
from mha_onnx.rewrite.check.verify import verify
from tests.models import ZOO


def own_exports() -> dict[str, callable]:
    from mha_onnx.export.mha import export_model

    def make(attention: str, mask: str):
        def build() -> onnx.ModelProto:
            import tempfile

            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "m.onnx"
                export_model(MhaConfig(d_model=64, num_heads=4, attention=attention, mask=mask), path)
                return onnx.load(path)

        return build

    return {f"mha_onnx_{a}_{m}": make(a, m) for a in ("self", "cross")
            for m in ("none", "key-padding", "causal")}


def ours(model: onnx.ModelProto) -> onnx.ModelProto:
    return fuse_model(model)[0]


def onnxscript_fuser(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    graph = ir.from_proto(model)
    optimize_for_ort(graph)
    return ir.to_proto(graph)


def ort_transformers(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.transformers.optimizer import optimize_model

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimized = optimize_model(model, model_type="bert", num_heads=0, hidden_size=0,
                                   opt_level=0, use_gpu=False)
    return optimized.model


FUSERS = {"mha-onnx": ours, "onnxscript optimize_for_ort": onnxscript_fuser,
          "ORT transformers optimizer": ort_transformers}


def counts(model: onnx.ModelProto) -> tuple[int, int]:
    """(attention blocks, blocks on an ONNX Runtime contrib kernel). A standard ONNX
    Attention op counts as a block that is not on a contrib kernel."""
    blocks = find_blocks(ir.from_proto(model).graph)
    contrib = sum(b.kind == "fused" and "com.microsoft." in b.op for b in blocks)
    return len(blocks), contrib


def evaluate(name: str, original: onnx.ModelProto) -> list[str]:
    before, _ = counts(original)
    row = [name, str(before)]
    for fuser in FUSERS.values():
        try:
            fused = fuser(onnx.ModelProto.FromString(original.SerializeToString()))
        except Exception as exc:  # noqa: BLE001 - a fuser crashing is a result
            row.append(f"crash: {type(exc).__name__}")
            continue
        _, on_kernel = counts(fused)
        try:
            result = verify(original, fused)
            worst = result.worst.stats.max_abs if result.worst else 0.0
            parity = f"{worst:.1e}" + ("" if result.passed else " FAIL")
        except MhaOnnxError as exc:
            parity = "does not run" if "onnxruntime" in str(exc) else f"error: {str(exc)[:40]}"
        row.append(f"{on_kernel}/{before} fused, {parity}")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    for noisy in ("onnxscript", "onnx_ir", "onnxruntime", "torch", "mha_onnx"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    graphs = {**own_exports(), **ZOO}
    names = args.names or list(graphs)
    header = ["graph", "attention blocks", *FUSERS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        row = evaluate(name, graphs[name]())
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    if args.out:
        intro = (f"Measured {datetime.date.today()} with "
                 f"`.venv/bin/python -m tools.compare_fusers {' '.join(argv or sys.argv[1:])}`. "
                 "Cells: blocks on an ONNX Runtime contrib attention kernel / attention blocks "
                 "in the original (a standard ONNX `Attention` op counts as a block, not as "
                 "fused), then the max abs error of the "
                 "fused model against the original on ORT CPU over mha-onnx's verification "
                 "shapes (FAIL: beyond 1e-4 fp32; `does not run`: ORT CPU refuses the output).")
        Path(args.out).write_text(intro + "\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
