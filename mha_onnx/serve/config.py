"""What an :class:`~mha_onnx.serve.engine.Engine` is asked to do (:class:`EngineConfig`) and
what it reports as it runs (:class:`Observer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mha_onnx.errors import ConfigError

if TYPE_CHECKING:
    from mha_onnx.serve.requests import Handle

IDLE_CHUNK = 512  # a prompt's positions a run takes while no row streams (and the default)


@dataclass(frozen=True)
class EngineConfig:
    """``max_batch``: rows decoded together; ``max_length``: positions a row may hold
    (prompt + new tokens; default the model's context, at most 4096); ``max_queue``:
    requests that may wait for a row (past it, :class:`QueueFull`); ``timeout``: seconds a
    request may take from submission (None: no limit); ``threads``: ORT's intra-op threads;
    ``float_prompt``: as ``generate`` (None: by the CPU; False: the file as written);
    ``prefill_chunk``: a prompt's positions run between two decode steps while rows stream
    (0: a whole prompt in one run, the run ``generate`` makes; smaller chunks bound how long
    the running rows wait for a joining prompt, at the cost of the joining request's first
    token: on the 16-layer int4 Llama at 16 clients, chunks of 64 cut the streams' p99 gap
    from 1.8 s to 0.23 s and put the median first token at 10.5 s instead of 2.0 s;
    docs/guide/serve.md). With no row streaming (nobody waits on the run) a run takes
    ``IDLE_CHUNK`` positions if that is more (the default's bound on a prompt run's memory);
    ``mixed_steps``: a chunk and the running rows' step in one run where the file allows it
    (serve/mixed.py: the weights read once for both), else one after the other."""

    max_batch: int = 16
    max_length: int | None = None
    max_queue: int = 64
    timeout: float | None = None
    threads: int | None = None
    float_prompt: bool | None = None
    prefill_chunk: int = IDLE_CHUNK
    mixed_steps: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"--max-length must be >= 2, got {self.max_length}")
        if self.max_queue < 0:
            raise ConfigError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigError(f"--request-timeout must be > 0 seconds, got {self.timeout}")
        if self.prefill_chunk < 0:
            raise ConfigError(f"--prefill-chunk must be >= 0, got {self.prefill_chunk}")


class Observer:
    """What the engine reports as it runs (the server's metrics implement it; no-ops here)."""

    def admitted(self, handle: Handle) -> None: ...
    def token(self, handle: Handle, now: float) -> None: ...
    def step(self, rows: int, seconds: float) -> None: ...
    def finished(self, handle: Handle) -> None: ...
