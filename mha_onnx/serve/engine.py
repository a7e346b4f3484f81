"""Continuous batching of a decoder on ONNX Runtime: requests join the running batch as soon
as their prompt has run and leave it when they end, so that many users share each decode
step (a step reads every weight whatever its batch).

    from mha_onnx.serve import Engine, EngineConfig, Request
    with Engine("model.onnx", EngineConfig(max_batch=8)) as engine:
        handle = engine.submit(Request(prompt=(1, 2, 3), max_tokens=32))
        for token in handle:  # as they come
            ...
        handle.result().finish_reason

One thread (the engine's) runs every ONNX Runtime call. Each turn of its loop: requests that
were cancelled, timed out or ended leave the batch (their rows freed), at most one waiting
request's prompt runs alone into a free row (in chunks while rows stream, so that they keep
stepping while prompts arrive; in chunks of at least IDLE_CHUNK while none does), then one
decode step runs for every row. Where the file allows it
(mixed.py), a prompt's chunk and the step are one run, which reads the weights once for
both. A prompt runs through the session ``generate`` would run it through (or one with the
same kernels, checked at start), and each row's step reads its own cache only, so a
request's greedy tokens are those of ``mha-onnx generate`` on it alone.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path

import numpy as np

from mha_onnx.errors import ConfigError, MhaOnnxError
from mha_onnx.generate.sampling import next_tokens
from mha_onnx.serve.config import IDLE_CHUNK, EngineConfig, Observer
from mha_onnx.serve.requests import (
    ERROR,
    LENGTH,
    SHUTDOWN,
    STOP,
    TIMEOUT,
    Handle,
    NotAdmitting,
    QueueFull,
    Request,
    Worker,
)

log = logging.getLogger(__name__)
DEFAULT_LENGTH = 4096  # a row's positions when the model's context is longer or unknown


class Engine(Worker):
    """A decoder file served to many requests at once (module doc)."""

    def __init__(self, model: str | Path, config: EngineConfig = EngineConfig(), *,
                 observer: Observer | None = None) -> None:
        from mha_onnx.generate.loop import Generator
        from mha_onnx.generate.prompt import floats_prompts
        from mha_onnx.graph.decoder import read_interface
        from mha_onnx.graph.files import read_model

        self.config, self.path = config, Path(model)
        self.observer = observer or Observer()
        proto = read_model(model, load_external_data=False)
        self.interface = iface = read_interface(proto, model)
        alone = _alone(iface, proto)
        mixed = None  # (none where prompts run in float compute: their chunks give other numbers)
        if iface.shared and not alone and config.max_batch > 1 and config.mixed_steps \
                and not floats_prompts(proto, config.float_prompt):
            from mha_onnx.serve.mixed import mixed_graph

            mixed = mixed_graph(proto)
        # (the step session's threads spin past its runs unless a mixed session runs between)
        self.generator = Generator(model, threads=config.threads, interface=iface,
                                   float_prompt=config.float_prompt, quiet=mixed is not None)
        self.max_length = self._length(config.max_length)
        self.rows, self.notes = self._rows(alone, mixed)
        self.eos = iface.tokens.eos
        self._queue: collections.deque[Handle] = collections.deque()
        self._running: dict[int, Handle] = {}  # row id (the handle's id) -> handle
        self._next: dict[int, int] = {}  # row id -> the token its next step feeds
        self._rngs: dict[int, np.random.Generator] = {}
        self._filling: Handle | None = None  # the request whose prompt is running
        self._filled = 0  # its positions run so far
        self._lock = threading.Condition()
        self._admitting, self._closed = True, False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="mha-onnx-engine", daemon=True)
        self._thread.start()

    def _length(self, asked: int | None) -> int:
        iface = self.interface
        limits = [v for v in (iface.position_limit, iface.context_length) if v]
        if asked is not None:
            if limits and asked > min(limits):
                raise ConfigError(f"--max-length {asked} is past the model's "
                                  f"{min(limits)} positions", hint=f"at most {min(limits)}")
            return asked
        return min([DEFAULT_LENGTH, *limits])

    def _rows(self, alone: str | None, mixed):
        """The store of the running rows (one slot where rows cannot share a step, ``alone``
        says why), with the ``mixed`` graph's runner where it agrees; and the notes."""
        from mha_onnx.serve.rows import AppendedRows, SharedRows

        batch = self.config.max_batch
        slots = 1 if alone else batch
        rows = SharedRows(self.generator, slots, self.max_length) if self.interface.shared \
            else AppendedRows(self.generator, slots)
        if mixed is not None:
            from mha_onnx.serve.mixing import mixed_runner

            rows.mixer = mixed_runner(self.generator, mixed)
        return rows, ((f"requests run one at a time: {alone}",) if alone and batch > 1 else ())

    # -- the caller's side -------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Refuses what the model cannot run (before the request takes a place)."""
        vocab = self.interface.vocab
        bad = [t for t in request.prompt if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token id(s) outside the vocabulary of {vocab}: {bad[:5]}",
                              hint=f"ids are 0..{vocab - 1}")
        needed = len(request.prompt) + request.max_tokens
        if len(request.prompt) >= self.max_length:
            raise ConfigError(f"the prompt's {len(request.prompt)} tokens leave no room in "
                              f"{self.max_length} positions", hint="shorten the prompt")
        if needed > self.max_length:
            raise ConfigError(f"the prompt's {len(request.prompt)} tokens and max_tokens "
                              f"{request.max_tokens} need {needed} positions, more than the "
                              f"{self.max_length} a row holds",
                              hint=f"max_tokens at most "
                                   f"{self.max_length - len(request.prompt)}")

    def submit(self, request: Request, on_event=None) -> Handle:
        """Queues ``request``; its handle at once. Raises ConfigError (a request the model
        cannot run), QueueFull, NotAdmitting."""
        self.check(request)
        handle = Handle(request, on_event)
        with self._lock:
            if not self._admitting:
                raise NotAdmitting("the server is shutting down", hint="retry elsewhere")
            if len(self._queue) >= self.config.max_queue + self.rows.free():
                raise QueueFull(f"{len(self._queue)} requests wait already",
                                hint="retry after a second")
            self._queue.append(handle)
            self._lock.notify_all()
        return handle

    @property
    def running(self) -> int:
        return len(self._running)

    def drain(self, grace: float | None = None) -> bool:
        """Stops admitting; waits up to ``grace`` seconds (None: for ever) for the queued and
        running requests to end, then ends what is left (``shutdown``). True when none was
        left to end."""
        deadline = None if grace is None else time.monotonic() + grace
        with self._lock:
            self._admitting = False
            self._lock.notify_all()
            clean = self._lock.wait_for(self._idle, None if deadline is None else
                                        max(0.0, deadline - time.monotonic()))
            for handle in self._handles():
                handle.cancel(SHUTDOWN)
            self._lock.notify_all()
            self._lock.wait_for(self._idle, 10.0)
        return bool(clean)

    def _idle(self) -> bool:
        return not self._queue and not self._running and self._filling is None

    def _handles(self) -> list[Handle]:
        return [*self._queue, *self._running.values(),
                *([self._filling] if self._filling is not None else [])]

    def close(self, grace: float | None = 0.0) -> None:
        """Drains (``grace``), stops the thread and closes the sessions."""
        if self._closed:
            return
        self.drain(grace)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(30.0)
        self.generator.close()
        if self.rows.mixer is not None:
            self.rows.mixer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine's thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closed or not self._idle()
                                    or not self._admitting, timeout=0.5)
                if self._closed:
                    break
                self._reap()
                if self._filling is None and self._queue and self.rows.free():
                    self._filling, self._filled = self._queue.popleft(), 0
                    self._filling.admitted = time.perf_counter()
                    self.observer.admitted(self._filling)
            filling = self._filling
            try:
                if filling is not None and self._running and self.rows.mixer is not None:
                    self._mixed(filling)
                    continue
                if filling is not None:
                    self._prefill(filling)
                if self._running:
                    self._step()
            except Exception as exc:  # a bug: the rows it touched end, the engine goes on
                log.exception("the engine failed; its running requests end")
                self._fail_all(f"internal error: {type(exc).__name__}: {exc}", filling)
        for handle in self._handles():
            handle._finish(SHUTDOWN)

    def _fail_all(self, error: str, admitting: Handle | None) -> None:
        for row in list(self._running):
            try:
                self._leave(row, ERROR, error)
            except Exception:  # noqa: BLE001 - (ending the others matters more)
                self._running.pop(row, None)
        if admitting is not None and not admitting.done:
            self.rows.abort(admitting.id)
            admitting._finish(ERROR, error)
        self._filling = None
        self._next.clear()
        self._rngs.clear()

    def _reap(self) -> None:
        """Ends what was cancelled or timed out, queued or running (under the lock)."""
        now = time.perf_counter()
        for handle in list(self._queue):
            reason = handle.cancel_reason or self._timed_out(handle, now)
            if reason:
                self._queue.remove(handle)
                self._end(handle, reason)
        for row, handle in list(self._running.items()):
            reason = handle.cancel_reason or self._timed_out(handle, now)
            if reason:
                self._leave(row, reason)
        filling = self._filling
        if filling is not None and (reason := filling.cancel_reason
                                    or self._timed_out(filling, now)):
            self.rows.abort(filling.id)
            self._filling = None
            self._end(filling, reason)

    def _timed_out(self, handle: Handle, now: float) -> str | None:
        deadline = handle.deadline(self.config.timeout)
        return TIMEOUT if deadline is not None and now >= deadline else None

    def _end(self, handle: Handle, reason: str, error: str | None = None) -> None:
        handle._finish(reason, error)
        self.observer.finished(handle)
        with self._lock:
            self._lock.notify_all()

    def _leave(self, row: int, reason: str, error: str | None = None) -> None:
        handle = self._running.pop(row)
        self._next.pop(row, None)
        self._rngs.pop(row, None)
        self.rows.leave(row)
        self._end(handle, reason, error)

    def _upto(self, handle: Handle) -> int:
        """Where this turn's run of ``handle``'s prompt ends: a chunk further while rows
        stream, else at least IDLE_CHUNK further (nobody waits on the run)."""
        n, chunk = len(handle.request.prompt), self.config.prefill_chunk
        if not chunk:
            return n
        return min(n, self._filled + (chunk if self._running else max(chunk, IDLE_CHUNK)))

    def _mixed(self, handle: Handle) -> None:
        """A step of the running rows and the next chunk of ``handle``'s prompt in one run
        (serve/mixed.py); where that run fails, each again on its own (a failure is then
        the request's that caused it)."""
        prompt, upto = list(handle.request.prompt), self._upto(handle)
        order = list(self.rows.order)
        started = time.perf_counter()
        try:
            step, logits = self.rows.mixed(np.array([self._next[r] for r in order], np.int64),
                                           handle.id, prompt, upto)
        except MhaOnnxError as exc:
            log.warning("a step with a prompt's chunk failed, each runs alone: %s", exc)
            self._prefill(handle)
            self._step()
            return
        self.steps += 1
        self.observer.step(len(order), time.perf_counter() - started)
        self._filled = upto
        for n, row in enumerate(order):
            self._emit(row, step[n:n + 1])
        if logits is not None:
            self._joined(handle, logits)

    def _prefill(self, handle: Handle) -> None:
        """The next chunk of ``handle``'s prompt (all of it without --prefill-chunk); at its
        end the row joins the batch with its first token."""
        prompt, upto = list(handle.request.prompt), self._upto(handle)
        try:
            logits = self.rows.prefill(handle.id, prompt, upto)
        except MhaOnnxError as exc:
            log.warning("request %s failed in its prompt run: %s", handle.id, exc)
            self.rows.abort(handle.id)
            self._filling = None
            self._end(handle, ERROR, str(exc))
            return
        self._filled = upto
        if logits is not None:
            self._joined(handle, logits)

    def _joined(self, handle: Handle, logits: np.ndarray) -> None:
        """``handle``'s prompt has run: its row joins the batch with its first token."""
        with self._lock:
            self._running[handle.id] = handle
            self._filling = None
        self._rngs[handle.id] = np.random.default_rng(handle.request.sampling.seed)
        self._emit(handle.id, logits[None])

    def _emit(self, row: int, logits: np.ndarray) -> None:
        """The next token of ``row`` from its logits; ends the row at EOS or max_tokens."""
        handle = self._running[row]
        request = handle.request
        token = int(next_tokens(logits, request.sampling, self._rngs[row])[0])
        now = time.perf_counter()
        handle._token(token, now)
        self.observer.token(handle, now)
        eos = self.eos if request.eos is None else request.eos
        if token in eos:
            self._leave(row, STOP)
        elif len(handle.tokens) >= request.max_tokens:
            self._leave(row, LENGTH)
        else:
            self._next[row] = token

    def _step(self) -> None:
        order = list(self.rows.order)
        tokens = np.array([self._next[r] for r in order], np.int64)
        started = time.perf_counter()
        try:
            logits = self.rows.step(tokens)
        except MhaOnnxError as exc:
            log.warning("a decode step of %d rows failed: %s", len(order), exc)
            for row in order:
                self._leave(row, ERROR, str(exc))
            return
        self.steps += 1
        self.observer.step(len(order), time.perf_counter() - started)
        for n, row in enumerate(order):
            self._emit(row, logits[n:n + 1])


def _alone(iface, proto) -> str | None:
    """Why the file's rows cannot share a step (each then runs alone), or None."""
    from mha_onnx.graph.cache import row_layout

    if not iface.has_positions:
        return ("it takes no position_ids: its positions come from the mask's length, so a "
                "row's tokens would depend on its place in the batch (export --model "
                "writes position_ids)")
    if iface.shared and row_layout(proto) is None:
        return ("its shared cache holds one length for every row (no per-row layout; "
                "fuse --kv-cache shared writes one)")
    return None
