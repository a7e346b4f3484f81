"""What a user asks the engine for, and the handle through which its tokens come back.

A :class:`Handle` is written by the engine's thread and read by anyone: its tokens as they
come (iterating it blocks), its :meth:`result`, or an ``on_event`` callback that the engine
calls from its thread for every token and once at the end (the HTTP server hands them to its
event loop). Nothing of one request is visible through another's handle.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mha_onnx.errors import ConfigError, MhaOnnxError
from mha_onnx.generate.sampling import Sampling

# why a request ended: its EOS ("stop" in OpenAI's words), max_tokens, the caller (a client
# gone, a stop string), its time limit, the model failing on it, the server shutting down
STOP, LENGTH, CANCELLED, TIMEOUT, ERROR, SHUTDOWN = (
    "stop", "length", "cancelled", "timeout", "error", "shutdown")

_ids = itertools.count()


class QueueFull(MhaOnnxError):
    """The engine's queue holds ``max_queue`` requests already (HTTP: 429)."""


class NotAdmitting(MhaOnnxError):
    """The engine is shutting down or closed (HTTP: 503)."""


class Worker:
    """What the engine and the embedder share: a queue served by a thread of their own, and
    whether they still admit requests."""

    _queue: Any
    _thread: threading.Thread
    _admitting: bool = True
    _closed: bool = False

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def admitting(self) -> bool:
        return self._admitting and not self._closed


@dataclass(frozen=True)
class Request:
    """One generation. ``eos``: token ids that end it (None: the model's own); ``timeout``:
    seconds from submission after which it ends (None: the engine's default)."""

    prompt: tuple[int, ...]
    max_tokens: int = 16
    sampling: Sampling = Sampling()
    eos: tuple[int, ...] | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if not self.prompt:
            raise ConfigError("the prompt is empty", hint="a prompt needs at least one token")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout}")


@dataclass(frozen=True)
class Completion:
    """A finished request: its new tokens (an EOS that ended it included), why it ended, and
    its timings (seconds)."""

    tokens: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    queued: float  # from submission to its prompt run
    time_to_first_token: float  # from submission
    seconds: float  # from submission to the end
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "queued_s": round(self.queued, 6),
                "time_to_first_token_s": round(self.time_to_first_token, 6),
                "seconds": round(self.seconds, 6), "error": self.error}


@dataclass(eq=False)
class Handle:
    """A submitted request (module doc). ``cancel()`` ends it within one engine step."""

    request: Request
    on_event: Callable[[str, Any], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    admitted: float | None = None
    first_token: float | None = None
    ended: float | None = None
    cancel_reason: str | None = None
    _done: threading.Condition = field(default_factory=threading.Condition)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self, reason: str = CANCELLED) -> None:
        """Ask the engine to end this request (its row freed before the next step)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def deadline(self, default: float | None) -> float | None:
        limit = self.request.timeout if self.request.timeout is not None else default
        return None if limit is None else self.submitted + limit

    # -- written by the engine's thread ----------------------------------------------------
    def _token(self, token: int, now: float) -> None:
        with self._done:
            self.tokens.append(token)
            if self.first_token is None:
                self.first_token = now
            self._done.notify_all()
        if self.on_event is not None:
            self.on_event("token", token)

    def _finish(self, reason: str, error: str | None = None) -> None:
        with self._done:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = reason, error
            self.ended = time.perf_counter()
            self._done.notify_all()
        if self.on_event is not None:
            self.on_event("done", self.completion())

    # -- read by anyone ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        """The new tokens as they come; ends with the request."""
        seen = 0
        while True:
            with self._done:
                self._done.wait_for(lambda n=seen: len(self.tokens) > n or self.done)
                fresh, finished = self.tokens[seen:], self.done
            yield from fresh
            seen += len(fresh)
            if finished and seen == len(self.tokens):
                return

    def result(self, timeout: float | None = None) -> Completion:
        """Waits for the end (``timeout`` seconds at most: TimeoutError past it)."""
        with self._done:
            if not self._done.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} still running after {timeout} s")
        return self.completion()

    def completion(self) -> Completion:
        ended = self.ended or time.perf_counter()
        admitted = self.admitted if self.admitted is not None else ended
        first = self.first_token if self.first_token is not None else ended
        return Completion(tuple(self.tokens), self.finish_reason or "", len(self.request.prompt),
                          admitted - self.submitted, first - self.submitted,
                          ended - self.submitted, self.error)
