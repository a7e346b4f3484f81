"""The llama.cpp anchor's weights: an HF folder to GGUF (float32), then Q4_0, with the
converter that ships in llama-cpp-python's sdist (never a dependency of the package).

    .venv-optimum/bin/python -m tools.gguf_anchor LLAMA_CPP_SRC HF_DIR OUT.gguf

LLAMA_CPP_SRC: the ``vendor/llama.cpp`` folder of the llama-cpp-python sdist (``pip download
--no-binary :all: --no-deps llama-cpp-python``, unpacked), which holds
``convert_hf_to_gguf.py`` and ``gguf-py``. The converter recognises a tokenizer by a hash of
how it splits a fixed text and refuses one it has never seen, such as the BPE tokenizer
trained here by tools/bench_optimum; that tokenizer splits as GPT-2's byte-level BPE does,
so the pre-tokenizer is named "gpt-2". Writes OUT with ``-f32`` before ``.gguf`` (the float
conversion, in this interpreter: it needs transformers, torch and sentencepiece, as
``.venv-optimum`` has them), then OUT in Q4_0 through
llama.cpp's own quantizer (in ``.venv-llama``: ``make bench-envs``).
"""

from __future__ import annotations

import ctypes
import runpy
import sys
from pathlib import Path


def readable(folder: Path, into: Path) -> Path:
    """``folder`` copied into ``into`` as the converter (transformers < 5 beside it) reads
    it: transformers 5 writes ``TokenizersBackend`` as the tokenizer class and the rotary
    base under ``rope_parameters``."""
    import json
    import shutil

    copy = into / folder.name
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    settings = copy / "tokenizer_config.json"
    if settings.is_file():
        data = json.loads(settings.read_text())
        if data.get("tokenizer_class") == "TokenizersBackend":
            data["tokenizer_class"] = "PreTrainedTokenizerFast"
        settings.write_text(json.dumps(data))
    config = json.loads((copy / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    (copy / "config.json").write_text(json.dumps(config, indent=1))
    return copy


def convert(source: Path, folder: Path, out: Path) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gguf_anchor_") as tmp:
        _convert(source, readable(folder, Path(tmp)), out)


def _convert(source: Path, folder: Path, out: Path) -> None:
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import conversion.base as base  # (the converter's own package, from ``source``)

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    argv, sys.argv = sys.argv, ["convert_hf_to_gguf.py", str(folder), "--outfile", str(out),
                                "--outtype", "f32"]
    try:
        runpy.run_path(str(source / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.argv = argv


def quantize(src: Path, dst: Path) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                      ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {src}")


def main(argv: list[str] | None = None) -> int:
    import subprocess

    args = argv or sys.argv[1:]
    if args[0] == "--quantize":  # (in .venv-llama)
        quantize(Path(args[1]), Path(args[2]))
        return 0
    source, folder, out = (Path(a) for a in args)
    floated = out.with_name(out.stem + "-f32.gguf")
    convert(source, folder, floated)
    root = Path(__file__).resolve().parents[1]
    subprocess.run([str(root / ".venv-llama" / "bin" / "python"), "-m", "tools.gguf_anchor",
                    "--quantize", str(floated), str(out)], cwd=root, check=True)
    print(f"{floated} (float32), {out} (Q4_0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
