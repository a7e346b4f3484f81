"""The server's Prometheus metrics (``GET /metrics``), fed by the engine as it runs (an
:class:`~mha_onnx.serve.engine.Observer`) and by the HTTP layer (requests and statuses).
Each server has its own registry, so that two in one process do not mix."""

from __future__ import annotations

import collections
import threading
import time

from mha_onnx.serve.config import Observer
from mha_onnx.serve.requests import Handle

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
            0.75, 1.0, 2.5, 5.0, 10.0)
_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW = 10.0  # seconds over which tokens/s is read


class Metrics(Observer):
    """The registry and every metric; the queue's depth and the running rows are read at
    scrape time from what :meth:`bind` gives."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("mha_onnx_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.endings = Counter("mha_onnx_requests_finished", "Generations ended, by reason",
                                ["reason"], registry=r)
        self._queue = self._running = lambda: 0
        Gauge("mha_onnx_queue_depth", "Requests waiting for a row",
              registry=r).set_function(lambda: self._queue())
        Gauge("mha_onnx_running_rows", "Rows in the running batch",
              registry=r).set_function(lambda: self._running())
        self._max_batch = Gauge("mha_onnx_max_batch", "Rows a step may hold", registry=r)
        self.occupancy = Histogram("mha_onnx_batch_occupancy", "Rows of each decode step over "
                                   "--max-batch", buckets=[i / 16 for i in range(1, 17)],
                                   registry=r)
        self.step_seconds = Histogram("mha_onnx_step_seconds", "Time of each decode step",
                                      buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("mha_onnx_prompt_tokens", "Prompt tokens run", registry=r)
        self.generated = Counter("mha_onnx_generation_tokens", "Tokens generated", registry=r)
        Gauge("mha_onnx_tokens_per_second", f"Tokens generated per second over the last "
              f"{RATE_WINDOW:.0f} s", registry=r).set_function(self.rate)
        self.ttft = Histogram("mha_onnx_time_to_first_token_seconds", "From a request's "
                              "arrival to its first token", buckets=_SECONDS, registry=r)
        self.itl = Histogram("mha_onnx_inter_token_latency_seconds", "Between two tokens of "
                             "one request", buckets=_LATENCY, registry=r)
        self.queued = Histogram("mha_onnx_queue_seconds", "From arrival to the prompt run",
                                buckets=_SECONDS, registry=r)
        self.duration = Histogram("mha_onnx_request_seconds", "From arrival to the end",
                                  buckets=_SECONDS, registry=r)
        self.max_batch = 1
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._last: dict[int, float] = {}  # request id -> its last token's time
        self._lock = threading.Lock()

    def bind(self, queue, running, max_batch: int) -> None:
        """Where the queue's depth and the running rows are read; the batch's size."""
        self._queue, self._running, self.max_batch = queue, running, max_batch
        self._max_batch.set(max_batch)

    def rate(self) -> float:
        now = time.perf_counter()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW

    # -- the engine's side ---------------------------------------------------------------------
    def admitted(self, handle: Handle) -> None:
        self.prompt_tokens.inc(len(handle.request.prompt))
        self.queued.observe(max(0.0, (handle.admitted or handle.submitted) - handle.submitted))

    def token(self, handle: Handle, now: float) -> None:
        self.generated.inc()
        with self._lock:
            self._recent.append((now, 1))
            last = self._last.get(handle.id)
            self._last[handle.id] = now
        if last is None:
            self.ttft.observe(now - handle.submitted)
        else:
            self.itl.observe(now - last)

    def step(self, rows: int, seconds: float) -> None:
        self.occupancy.observe(rows / self.max_batch)
        self.step_seconds.observe(seconds)

    def finished_request(self, reason: str, seconds: float) -> None:
        self.endings.labels(reason).inc()
        self.duration.observe(seconds)

    def finished(self, handle: Handle) -> None:
        with self._lock:
            self._last.pop(handle.id, None)
        self.finished_request(handle.finish_reason or "", (handle.ended or time.perf_counter())
                              - handle.submitted)

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
