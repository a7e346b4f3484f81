"""What fuse makes of decoders written by others: every Hugging Face family of tests/models.py
(one layer from a tiny config, random weights, nothing downloaded), eager and SDPA attention,
opset 18 and 23, float32 (and float16 for eager at opset 18).

    .venv/bin/python -m tools.decoder_forms [--families gpt2,llama,...] [--out FILE.md]

For each graph: the attention blocks found, the form each was lowered to and what it was
understood as, and fuse's verification over every branch of the fused graph
(``verification_cases``: right and left padding, a fully padded row, lengths across every
threshold), as the max abs error against the original on ORT CPU. A graph torch cannot
export or ORT cannot run is listed with the reason instead of stopping the table.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import re
import sys
import warnings
from pathlib import Path

from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.check.cases import verification_cases
from mha_onnx.rewrite.check.verify import verify

VARIANTS = [("eager", 18, "float32"), ("sdpa", 18, "float32"), ("eager", 23, "float32"),
            ("sdpa", 23, "float32"), ("eager", 18, "float16")]


def row(family: str, attn: str, opset: int, dtype: str) -> list[str]:
    from tests.models import hf_decoder

    head = [family, attn, str(opset), dtype]
    try:
        model = hf_decoder(family, attn, opset, dtype)
    except Exception as exc:  # noqa: BLE001 - a table row, not a crash
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # no terminal colours
        why = text.splitlines()[0] if text else ""
        return head + ["-", "-", "-", f"export failed: {type(exc).__name__}: {why}"[:160]]
    try:
        fused, results, _ = fuse_model(model)
        check = verify(model, fused, cases=verification_cases(model, results))
    except Exception as exc:  # noqa: BLE001
        return head + ["-", "-", "-", f"fuse failed: {type(exc).__name__}: {exc}"[:120]]
    fused_forms = sorted({r.form for r in results if r.status == "fused"})
    meanings = sorted({r.meaning for r in results if r.meaning})
    left = [r.reason for r in results if r.status == "left"]
    worst = check.worst
    verdict = ("passed" if check.passed else "FAILED") + \
        (f", max abs {worst.stats.max_abs:.1e}" if worst else "")
    if check.skipped:
        verdict += f" ({len(check.skipped)} case(s) the original cannot run)"
    blocks = f"{len(results) - len(left)}/{len(results)} fused"
    return head + [blocks, "; ".join(fused_forms) or "-", "; ".join(meanings) or "-", verdict]


def main() -> None:
    from tests.models import DECODERS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(DECODERS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    command = "python -m tools.decoder_forms " + " ".join(sys.argv[1:])
    lines = [f"Measured {datetime.date.today()} with `{command}` (torch.onnx dynamo export of "
             "one decoder layer per family, tiny configs, random weights, an all-ones "
             "`attention_mask` input; verification: max abs error of the fused graph against "
             "the original on ORT CPU over fuse's verification shapes, every branch).", "",
             "| family | attention | opset | dtype | blocks | form | understood as | verified |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for family in args.families.split(","):
        for attn, opset, dtype in VARIANTS:
            cells = [c.replace("|", "\\|") for c in row(family, attn, opset, dtype)]
            line = "| " + " | ".join(cells) + " |"
            lines.append(line)
            print(line, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
