"""OpenAI's request bodies read into what the engine runs, and its response bodies written.

What the server takes: ``/v1/completions`` (``prompt``: a string, or token ids) and
``/v1/chat/completions`` (``messages`` through the folder's chat template) with ``model``,
``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature`` (0: greedy; OpenAI's
default 1 samples), ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``user`` and vLLM's ``ignore_eos`` (benchmarks: every
output runs to ``max_tokens``); ``/v1/embeddings`` with ``input`` (a string,
token ids, or a list of either), ``model``, ``encoding_format: "float"`` and ``user``.
Anything else a client may send (``n`` > 1, ``logprobs``, ``echo``, penalties, tools, ...)
is refused by name, never ignored: a field the server would not honour changes what the
client gets.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from mha_onnx.errors import MhaOnnxError
from mha_onnx.generate.sampling import Sampling


class BadRequest(MhaOnnxError):
    """A request body the server does not take (HTTP 400)."""

    status = 400


class UnknownModel(MhaOnnxError):
    """A ``model`` the server does not serve (HTTP 404)."""

    status = 404


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "user", "n", "logprobs", "presence_penalty", "frequency_penalty",
           "logit_bias", "best_of", "ignore_eos"}
FIELDS = {"completion": _COMMON | {"prompt", "echo", "suffix"},
          "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
          "embedding": {"input", "model", "encoding_format", "user", "dimensions"}}
# fields a client may send at their neutral value (as the OpenAI clients do): refused otherwise
_NEUTRAL = {"n": (1,), "best_of": (1,), "logprobs": (None, False), "top_logprobs": (None, 0),
            "echo": (False,), "suffix": (None, ""), "presence_penalty": (0, 0.0),
            "frequency_penalty": (0, 0.0), "logit_bias": (None, {}), "dimensions": (None,),
            "encoding_format": ("float", None)}


@dataclass(frozen=True)
class Call:
    """One generation as the engine runs it, and how its answer is written."""

    kind: str  # "completion" | "chat"
    prompt: tuple[int, ...]
    max_tokens: int | None  # None: as many as the row holds
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False


def check_fields(body: Any, kind: str, served: str) -> None:
    """Refuses a body that is not an object, fields the server does not take (named), and a
    ``model`` it does not serve."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body is a JSON {type(body).__name__}, not an object")
    unknown = sorted(set(body) - FIELDS[kind])
    refused = sorted(k for k, ok in _NEUTRAL.items() if k in body and body[k] not in ok)
    if unknown or refused:
        parts = ([f"unknown field(s): {', '.join(unknown)}"] if unknown else []) + \
            ([f"unsupported value(s): {', '.join(f'{k}={body[k]!r}' for k in refused)}"]
             if refused else [])
        raise BadRequest("; ".join(parts), hint="this server takes n=1 and no logprobs, "
                                                "echo, penalties, logit_bias or tools")
    model = body.get("model")
    if model is not None and model != served:
        raise UnknownModel(f"the model {model!r} is not served here (this server serves "
                           f"{served!r})", hint="GET /v1/models lists it")


def _number(body: dict, key: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{key} must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise BadRequest(f"{key} must be in {'(' if low_open else '['}{low}, {high}], "
                         f"got {value}")
    return float(value)


def _integer(body: dict, key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}")
    if value < low:
        raise BadRequest(f"{key} must be >= {low}, got {value}")
    return value


def sampling(body: dict) -> Sampling:
    """OpenAI's sampling fields: temperature 0 is greedy; no seed, a fresh one."""
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < -1):
        raise BadRequest(f"top_k must be an integer >= -1 (-1 or 0: every token), got {top_k!r}")
    seed = _integer(body, "seed", -(1 << 63))
    if seed is None:
        seed = uuid.uuid4().int >> 65
    if temperature == 0:
        return Sampling(seed=seed % (1 << 63))
    return Sampling(True, temperature, max(0, top_k or 0), top_p, seed % (1 << 63))


def stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) and s for s in values):
        raise BadRequest("stop must be a non-empty string or a list of them")
    return tuple(values)


def stream_fields(body: dict) -> tuple[bool, bool]:
    stream, options = body.get("stream", False), body.get("stream_options")
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise BadRequest("stream_options takes include_usage only")
    return bool(stream), bool((options or {}).get("include_usage"))


def token_list(value: Any) -> list[int] | None:
    """``value`` as token ids where it is a list of integers, else None."""
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in value):
        return list(value)
    return None


def completion_prompt(body: dict, text) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a list of one prompt
    ids = token_list(prompt)
    if ids is not None:
        return ids
    if isinstance(prompt, str) and prompt:
        if text is None:
            raise BadRequest("this model's folder has no tokenizer.json: give the prompt as "
                             "token ids", hint='"prompt": [1, 2, 3]')
        return text.encode(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("one prompt per request (a list of prompts is n > 1)",
                         hint="send the prompts as requests of their own")
    raise BadRequest("prompt must be a non-empty string or a list of token ids")


def chat_prompt(body: dict, text) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}")
    out = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{n}] is not an object with a role")
        content = message.get("content")
        if isinstance(content, list):  # parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{n}].content: only text parts are taken")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{n}].content must be a string or text parts")
        out.append({"role": message["role"], "content": content})
    if text is None:
        raise BadRequest("this model's folder has no tokenizer.json, so no chat template")
    return text.chat(out)


def read_call(body: Any, kind: str, served: str, text) -> Call:
    """``body`` of ``/v1/completions`` (kind "completion") or ``/v1/chat/completions``
    ("chat") as a :class:`Call`; BadRequest / UnknownModel otherwise."""
    check_fields(body, kind, served)
    prompt = completion_prompt(body, text) if kind == "completion" else chat_prompt(body, text)
    max_tokens = _integer(body, "max_tokens", 1)
    if kind == "chat":
        max_tokens = _integer(body, "max_completion_tokens", 1) or max_tokens
    elif max_tokens is None:
        max_tokens = 16  # (OpenAI's default for completions)
    stop = stops(body)
    if stop and text is None:
        raise BadRequest("stop strings need the model's tokenizer (no tokenizer.json)")
    stream, usage = stream_fields(body)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be true or false, got {ignore_eos!r}")
    return Call(kind, tuple(prompt), max_tokens, sampling(body), stop, stream, usage, ignore_eos)


# -- answers -------------------------------------------------------------------------------------

def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def body(kind: str, rid: str, model: str, text: str, tokens: list[int], reason: str,
         prompt: int) -> dict[str, Any]:
    """A whole answer."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(reason),
                              "logprobs": None, "token_ids": tokens}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(prompt, len(tokens))}


def chunk(kind: str, rid: str, model: str, text: str | None, tokens: list[int],
          reason: str | None, first: bool = False) -> dict[str, Any]:
    """One streamed event (``reason``: the last one's)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason and finish_reason(reason),
                              "logprobs": None, "token_ids": tokens}
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else
            "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice]}


def error(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
            503: "service_unavailable", 504: "timeout"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
