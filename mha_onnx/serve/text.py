"""Text for the server: the folder's tokenizer (``tokenizer.json`` through the ``tokenizers``
library, as transformers' fast tokenizers run it), its chat template (``tokenizer_config.json``
or ``chat_template.jinja``, rendered as transformers renders it: a sandboxed Jinja2 with
``trim_blocks``/``lstrip_blocks``), and the text of a stream of tokens as it grows, cut at a
stop string."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha_onnx.errors import ConfigError, ModelFileError

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class Text:
    """A folder's tokenizer and chat template (None where it has none)."""

    tokenizer: Any
    config: dict[str, Any]
    template: str | None
    folder: Path

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_id(self, name: str) -> int | None:
        token = _special(self.config.get(name))
        return None if token is None else self.tokenizer.token_to_id(token)

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of ``messages`` through the chat template, with the prompt of the
        assistant's turn (transformers' ``apply_chat_template(..., add_generation_prompt=True)``;
        the template writes the special tokens itself)."""
        if self.template is None:
            raise ConfigError(f"the model's folder {self.folder} has no chat template",
                              hint="use /v1/completions, or add chat_template to "
                                   "tokenizer_config.json")
        from jinja2 import TemplateError

        try:
            text = _compiled(self.template).render(
                messages=messages, add_generation_prompt=True,
                **{name: _special(self.config.get(name)) for name in _SPECIAL})
        except TemplateError as exc:
            raise ConfigError(f"the chat template refused the messages: {exc}") from None
        return self.encode(text, special=False)


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str):
    if source not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                       ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: __import__("time").strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


def _template(folder: Path, config: dict[str, Any]) -> str | None:
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    jinja = folder / "chat_template.jinja"
    if not source and jinja.is_file():
        source = jinja.read_text()
    return source or None


def load_text(folder: str | Path) -> Text | None:
    """The tokenizer of ``folder`` (its tokenizer.json), or None where it has none."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the library's own error types vary
        raise ModelFileError(f"cannot read {path}: {' '.join(str(exc).split())[:200]}") from None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = {}
    return Text(tokenizer, config, _template(folder, config), folder)


class TextStream:
    """The text of a growing list of tokens, handed out as it becomes final: nothing that
    ends inside a multi-byte character, nothing that could be the start of a stop string,
    and nothing from a stop string on (OpenAI's ``stop``: the text ends before it)."""

    def __init__(self, text: Text | None, stop: tuple[str, ...] = ()) -> None:
        self.text, self.stop = text, stop
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """The new final text after ``token`` ('' where none); sets ``stopped`` at a stop."""
        self.ids.append(token)
        if self.text is None or self.stopped:
            return ""
        full = self.text.decode(self.ids)
        if full.endswith("\ufffd"):  # (a character not complete yet)
            return ""
        found = [i for s in self.stop if (i := full.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        if found:
            self.stopped = True
            return self._take(full, min(found))
        hold = max((k for s in self.stop for k in range(1, len(s))
                    if full.endswith(s[:k])), default=0)
        return self._take(full, len(full) - hold)

    def _take(self, full: str, end: int) -> str:
        out = full[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def flush(self) -> str:
        """What was held back, at the end of a stream that did not stop on a string."""
        if self.text is None or self.stopped:
            return ""
        return self._take(self.text.decode(self.ids), 1 << 62)
