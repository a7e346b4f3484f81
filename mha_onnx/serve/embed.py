"""Embeddings from an encoder on ONNX Runtime, batched dynamically: inputs that arrive within
``window`` seconds of the first waiting one run as one right-padded batch (the mask 0 on
padding), at most ``max_batch`` inputs a run, then each input's token vectors are pooled as
the folder's sentence-transformers config says (``modules.json`` and ``1_Pooling/config.json``,
with its ``Normalize`` module), else by the mean over kept tokens.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.errors import ConfigError
from mha_onnx.serve.requests import NotAdmitting, QueueFull, Worker

log = logging.getLogger(__name__)
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class Pooling:
    """How token vectors become one: ``mode`` cls | mean | max | last; ``normalize``: to unit
    length; ``source``: where it was read ("default": nowhere, the mean)."""

    mode: str = "mean"
    normalize: bool = False
    source: str = "default"

    def describe(self) -> str:
        return f"{self.mode} pooling{', normalized' if self.normalize else ''} ({self.source})"

    def __call__(self, tokens_BSH: np.ndarray, mask_BS: np.ndarray) -> np.ndarray:
        kept = mask_BS.astype(bool)
        if self.mode == "cls":
            out = tokens_BSH[:, 0]
        elif self.mode == "last":
            last = kept.shape[1] - 1 - np.argmax(kept[:, ::-1], axis=1)
            out = tokens_BSH[np.arange(len(last)), last]
        elif self.mode == "max":
            out = np.where(kept[..., None], tokens_BSH, -np.inf).max(axis=1)
        else:
            weights = kept[..., None].astype(np.float64)
            out = (tokens_BSH * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        out = out.astype(np.float32)
        if self.normalize:
            out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out


def read_pooling(folders: list[Path]) -> Pooling:
    """The first folder's sentence-transformers pooling (module doc), else the mean."""
    for folder in folders:
        try:
            modules = json.loads((folder / "modules.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        pool = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
        if pool is None:
            continue
        try:
            config = json.loads((folder / pool.get("path", "") / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        mode = next((name for key, name in _MODES.items() if config.get(key)), "mean")
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        return Pooling(mode, normalize, f"{folder / 'modules.json'}")
    return Pooling()


class Embedder(Worker):
    """An encoder file served with dynamic batching (module doc)."""

    def __init__(self, model: str | Path, pooling: Pooling, *, max_batch: int = 32,
                 window: float = 0.005, max_queue: int = 256, max_length: int | None = None,
                 threads: int | None = None, observer: Any = None) -> None:
        from mha_onnx.runtime.ort import OrtRunner

        self.runner = OrtRunner(str(model), "cpu", threads=threads)
        session = self.runner.session
        self.inputs = {i.name: i for i in session.get_inputs()}
        if "input_ids" not in self.inputs:
            raise ConfigError(f"{Path(model).name} takes no input_ids: not a text encoder",
                              hint="serve embeds with encoders exported for feature-extraction")
        self.output = self._output(session)
        # without a mask, padding would change the vectors: one input a run
        self.pooling, self.window = pooling, window
        self.max_batch = max_batch if "attention_mask" in self.inputs else 1
        self.max_queue, self.max_length, self.observer = max_queue, max_length, observer
        self._queue: collections.deque[tuple[list[int], Future]] = collections.deque()
        self._lock = threading.Condition()
        self._admitting, self._closed, self.runs = True, False, 0
        self._thread = threading.Thread(target=self._loop, name="mha-onnx-embedder", daemon=True)
        self._thread.start()

    @staticmethod
    def _output(session) -> str:
        names = [o.name for o in session.get_outputs()]
        for name in ("last_hidden_state", "token_embeddings"):
            if name in names:
                return name
        three = [o.name for o in session.get_outputs() if len(o.shape) == 3]
        if not three:
            raise ConfigError("the encoder has no [batch, tokens, hidden] output to pool",
                              hint="export it with --task feature-extraction")
        return three[0]

    def submit(self, ids: list[int]) -> Future:
        """The pooled vector of ``ids`` (a Future of float32 [hidden])."""
        if not ids:
            raise ConfigError("an input is empty")
        if self.max_length is not None and len(ids) > self.max_length:
            raise ConfigError(f"an input of {len(ids)} tokens is past the model's "
                              f"{self.max_length} positions", hint="shorten it")
        future: Future = Future()
        with self._lock:
            if not self._admitting:
                raise NotAdmitting("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} inputs wait already",
                                hint="retry after a second")
            self._queue.append((list(ids), future))
            self._lock.notify_all()
        return future

    def drain(self, grace: float | None = None) -> bool:
        with self._lock:
            self._admitting = False
            return bool(self._lock.wait_for(lambda: not self._queue, grace))

    def close(self, grace: float | None = 0.0) -> None:
        self.drain(grace)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(30.0)
        for _, future in self._queue:
            future.set_exception(NotAdmitting("the server shut down"))
        self.runner.close()

    def _take(self) -> list[tuple[list[int], Future]]:
        with self._lock:
            self._lock.wait_for(lambda: self._queue or self._closed, 0.5)
            if not self._queue:
                return []
            first = time.perf_counter()
            while len(self._queue) < self.max_batch and not self._closed:
                left = self.window - (time.perf_counter() - first)
                if left <= 0 or not self._lock.wait(left):
                    break
            batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            self._lock.notify_all()
            return batch

    def _loop(self) -> None:
        while not self._closed:
            batch = self._take()
            if batch:
                self._run(batch)

    def feeds(self, rows: list[list[int]]) -> dict[str, np.ndarray]:
        """A right-padded batch of ``rows`` as the model's inputs."""
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros((len(rows), width), np.int64)
        for b, row in enumerate(rows):
            ids[b, :len(row)], mask[b, :len(row)] = row, 1
        values = {"input_ids": ids, "attention_mask": mask,
                  "token_type_ids": np.zeros_like(ids), "position_ids": np.maximum(
                      np.cumsum(mask, axis=1) - 1, 0)}
        return {name: values[name].astype(_dtype(spec.type))
                for name, spec in self.inputs.items() if name in values}

    def _run(self, batch: list[tuple[list[int], Future]]) -> None:
        rows = [ids for ids, _ in batch]
        try:
            feeds = self.feeds(rows)
            tokens = self.runner.session.run([self.output], feeds)[0]
            pooled = self.pooling(np.asarray(tokens, np.float64), feeds["attention_mask"])
        except Exception as exc:  # noqa: BLE001 - one batch fails, not the server
            log.warning("an embedding run of %d inputs failed: %s", len(rows), exc)
            for _, future in batch:
                future.set_exception(exc)
            return
        self.runs += 1
        if self.observer is not None:
            self.observer.step(len(rows), 0.0)
        for (_, future), vector in zip(batch, pooled, strict=True):
            future.set_result(vector)


def _dtype(kind: str) -> type:
    return {"tensor(int32)": np.int32, "tensor(float)": np.float32}.get(kind, np.int64)
