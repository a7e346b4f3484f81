"""ONNX Runtime GenAI's generator, run in its own environment (`make genai-env`:
.venv-genai-rt; its onnxruntime is 1.32, ours 1.31) through tools/genai_generate.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def genai_python() -> str | None:
    """The Python of GenAI's environment, where it is installed."""
    given = os.environ.get("MHA_ONNX_GENAI_PYTHON")
    for candidate in ([given] if given else []) + [str(ROOT / ".venv-genai-rt" / "bin" / "python")]:
        if candidate and Path(candidate).is_file():
            return candidate
    return None


needs_genai = pytest.mark.skipif(genai_python() is None,
                                 reason="onnxruntime-genai is not installed (make genai-env)")


def genai_generate(folder: Path, prompts: list[list[int]], new: int, mode: str) -> dict:
    """GenAI's tokens (EOS left out) for ``prompts``: one batch (right-padded) or each alone."""
    prompts_file = folder / f"prompts.{mode}.json"
    prompts_file.write_text(json.dumps(prompts))
    done = subprocess.run([genai_python() or sys.executable,
                           str(ROOT / "tools" / "genai_generate.py"), str(folder),
                           "--prompts", str(prompts_file), "--max-new-tokens", str(new),
                           "--mode", mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def without_eos(rows, eos) -> list[list[int]]:
    return [[t for t in row if t not in eos] if row and row[-1] in eos else list(row)
            for row in rows]
