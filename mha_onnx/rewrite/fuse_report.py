"""What ``fuse`` answers: one result per attention block (fused into a form, or left with
the reason) and the report of a run, rendered as a table or as JSON from the same object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mha_onnx.rewrite.check.verify import Verification
from mha_onnx.rewrite.forms import Form
from mha_onnx.table import table


@dataclass(frozen=True)
class BlockResult:
    """One attention block: fused into ``form``, or left with ``reason``."""

    block: str
    status: str  # "fused" | "left" | "already fused"
    form: str = ""  # the chosen form's label, rendered from ``chosen``
    chosen: Form | None = field(default=None, compare=False, repr=False)
    mask: str = ""  # the mask family: none | causal | key_padding | bias
    reason: str = ""
    meaning: str = ""  # the block as understood, e.g. "causal + key padding, 8 q / 2 kv heads"
    details: dict[str, Any] = field(default_factory=dict)

    def said(self) -> str:
        """One line: the form it was fused into, else the block, its status and the reason
        (``export --model``'s "fused:" line)."""
        if self.status == "fused" and self.form:
            return self.form
        return f"{self.block} {self.status}" + (f" ({self.reason})" if self.reason else "")

    def to_dict(self) -> dict[str, Any]:
        return {"block": self.block, "status": self.status, "form": self.form,
                "mask": self.mask, "meaning": self.meaning, "reason": self.reason,
                **self.details}


@dataclass(frozen=True)
class FuseReport:
    input: str
    output: str | None
    target: str
    blocks: tuple[BlockResult, ...]
    verification: Verification | None
    seconds: float
    written: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fused(self) -> int:
        return sum(b.status == "fused" for b in self.blocks)

    @property
    def left(self) -> int:
        return sum(b.status == "left" for b in self.blocks)

    def __bool__(self) -> bool:
        return self.verification is None or self.verification.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "input": self.input,
            "output": self.output,
            "target": self.target,
            "written": self.written,
            "fused": self.fused,
            "left": self.left,
            "already_fused": sum(b.status == "already fused" for b in self.blocks),
            "blocks": [b.to_dict() for b in self.blocks],
            "verification": None if self.verification is None else self.verification.to_dict(),
            "seconds": round(self.seconds, 3),
            "notes": list(self.notes),
        }

    def render(self) -> str:
        head = (f"fused {self.fused} of {len(self.blocks)} attention block(s) for target "
                f"{self.target} in {self.seconds:.1f} s")
        lines = [head]
        if self.blocks:
            rows = []
            for b in self.blocks:  # a form behind guards: one row per branch, not 200 columns
                parts = (b.form or "-").split(" | ")
                rows.append((b.block, b.status, parts[0], b.meaning or b.mask or "-",
                             b.reason or ""))
                rows += [("", "", f"| {part}", "", "") for part in parts[1:]]
            lines.append(table(["block", "status", "form", "understood as", "reason"], rows))
        if self.verification is None:
            lines.append("  verification: skipped (--no-verify)")
        else:
            worst = self.verification.worst
            state = "passed" if self.verification.passed else "FAILED"
            detail = (f"worst max abs {worst.stats.max_abs:.2e} ({worst.output}, {worst.case})"
                      if worst else "no outputs")
            lines.append(f"  verification vs original ({self.verification.reference}): {state}; {detail}")
            lines.extend(f"  unchecked: {why}" for why in self.verification.skipped)
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.output:
            lines.append(f"  {'wrote' if self.written else 'did not write'} {self.output}")
        return "\n".join(lines)
