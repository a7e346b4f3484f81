"""Prompts as users have them: a JSON list of token-id lists, or of strings with a Hugging
Face tokenizer folder (tokenizer.json and its config; nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mha_onnx.errors import ConfigError, ModelFileError


def load_tokenizer(folder: str | Path) -> Any:
    """transformers' tokenizer of a local folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFileError(f"--tokenizer {folder} is not a folder",
                             hint="pass the HF folder holding tokenizer.json")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelFileError(f"cannot read a tokenizer from {folder}: "
                             f"{' '.join(str(exc).split())[:300]}",
                             hint="the folder needs tokenizer.json (or the files of a slow "
                                  "tokenizer) and tokenizer_config.json") from None


def load_prompts(path: str | Path, tokenizer: Any = None, option: str = "--prompts"
                 ) -> list[list[int]]:
    """Token-id lists from a JSON file: ids as they are; strings through ``tokenizer``
    (``option``: the one errors name)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {option} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option} {path} is not JSON: {exc}",
                          hint='e.g. [[1, 2, 3], [4, 5]], or ["text", ...] with --tokenizer'
                          ) from None
    if not isinstance(data, list):
        raise ConfigError(f"{option} {path} holds a {type(data).__name__}, not a list",
                          hint="a list of prompts: [[1, 2, 3], [4, 5]]")
    if any(isinstance(p, str) for p in data):
        if not all(isinstance(p, str) for p in data):
            raise ConfigError(f"{option} {path} mixes text and token ids")
        if tokenizer is None:
            raise ConfigError(f"{option} {path} holds text", hint="pass --tokenizer DIR"
                              if option == "--prompts" else "token ids, or the model's "
                              "tokenizer.json beside it")
        return [list(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in data]
    for n, prompt in enumerate(data):
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
            raise ConfigError(f"{option} {path}: prompt {n} is not a list of token ids",
                              hint="e.g. [[1, 2, 3], [4, 5]]")
    return [list(p) for p in data]


def decode(tokenizer: Any, sequences) -> tuple[str, ...]:
    return tuple(tokenizer.decode(list(s), skip_special_tokens=True) for s in sequences)
