"""What every runner shares (``Runner``) and what a runtime does on a provider
(``Capabilities``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    """What a runtime does on one provider, read by validate and profile instead of asking
    which runtime it is (as Polygraphy's runners keep runtime differences behind one base)."""

    runtime: str  # "onnxruntime" | "openvino"
    label: str  # how reports name it: "ort cuda", "openvino:GPU"
    device: str  # "CPU", "CUDA", "GPU", ...
    child_preflight: bool  # meets a model in a child process first (a crash there is a result)
    op_profile: bool  # per-operator times and traces
    places_nodes_on_cpu: bool  # may run some nodes on the CPU under another provider


class Runner:
    """What every runner shares: a context manager that builds its session on entry and
    drops it on exit (``session`` and ``close`` are the runner's own), and what it can do
    on a provider (``capabilities``)."""

    session: Any

    @classmethod
    def capabilities(cls, provider: str) -> Capabilities:
        raise NotImplementedError

    def __enter__(self):
        self.session  # noqa: B018 (build now)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError
