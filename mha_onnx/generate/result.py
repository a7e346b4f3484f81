"""What a generation is asked (``GenerationConfig``) and what it gives back
(``GenerationResult``: the new tokens of each row, why each ended, and the run's timings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mha_onnx.errors import ConfigError
from mha_onnx.generate.sampling import Sampling
from mha_onnx.graph.decoder import DecoderInterface


@dataclass(frozen=True)
class GenerationConfig:
    """``max_length``: positions of a shared cache's buffers (default: the longest prompt
    plus ``max_new_tokens``, which every run needs); ``eos``: token ids that end a row
    (None: the model's own, from its metadata or HF config)."""

    max_new_tokens: int = 32
    sampling: Sampling = Sampling()
    eos: tuple[int, ...] | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"--max-length must be >= 2, got {self.max_length}")


@dataclass(frozen=True)
class GenerationResult:
    """New tokens per row (an EOS that ended a row included) and the timings of the run."""

    sequences: tuple[tuple[int, ...], ...]
    prompt_lengths: tuple[int, ...]
    stopped: tuple[str, ...]  # per row: "eos" or "length"
    time_to_first_token_ms: float
    seconds: float
    steps: int  # runs after the prompt
    decode_seconds: float
    ort_seconds: float  # inside ONNX Runtime's run, prompt and steps
    interface: DecoderInterface
    eos: tuple[int, ...]
    sampling: Sampling
    texts: tuple[str, ...] | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def new_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def tokens_per_s(self) -> float:
        """New tokens of every row over the whole run (prompt included)."""
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the steps after the prompt (batch x steps / their time)."""
        batch = len(self.sequences)
        return batch * self.steps / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {"sequences": [list(s) for s in self.sequences],
               "prompt_lengths": list(self.prompt_lengths), "stopped": list(self.stopped),
               "new_tokens": self.new_tokens,
               "time_to_first_token_ms": round(self.time_to_first_token_ms, 3),
               "tokens_per_s": round(self.tokens_per_s, 2),
               "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
               "ms_per_step": round(1e3 * self.decode_seconds / max(1, self.steps), 3),
               "seconds": round(self.seconds, 4),
               "ort_share": round(self.ort_seconds / self.seconds, 4) if self.seconds else None,
               "steps": self.steps, "eos_token_id": list(self.eos),
               "sampling": self.sampling.to_dict(), "model": self.interface.to_dict(),
               "notes": list(self.notes)}
        if self.texts is not None:
            out["texts"] = list(self.texts)
        return out

    def render(self) -> str:
        rows = len(self.sequences)
        lines = [f"generated {self.new_tokens} token(s) for {rows} prompt(s) "
                 f"({self.interface.form} cache, "
                 f"{'sampled' if self.sampling.sample else 'greedy'}): "
                 f"first token {self.time_to_first_token_ms:.1f} ms, "
                 f"{self.decode_tokens_per_s:.1f} tokens/s after it "
                 f"({1e3 * self.decode_seconds / max(1, self.steps):.2f} ms per step, "
                 f"{100 * self.ort_seconds / max(self.seconds, 1e-9):.0f} % inside ONNX "
                 "Runtime)"]
        for n, seq in enumerate(self.sequences):
            shown = repr(self.texts[n]) if self.texts is not None else \
                " ".join(str(t) for t in seq)
            lines.append(f"  [{n}] ({self.prompt_lengths[n]} prompt tokens, "
                         f"{len(seq)} new, {self.stopped[n]}) {shown}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
