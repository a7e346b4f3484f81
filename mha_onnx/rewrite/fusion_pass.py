"""The base of fuse's passes (passes.py): the ``Facts`` they hand on, the ``FusionResult``
each returns, and ``FusionPass`` (settings and facts in ``__init__``; ``requires`` checks the
target's list and the facts it ``NEEDS``, ``ensures`` those it ``GIVES``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import onnx_ir as ir

from mha_onnx.rewrite.forms import Form
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.recognise.core import BlockLog
from mha_onnx.rewrite.tighten.rotary_fold import Folded

_KINDS: list[type] = []  # every FusionPass subclass, in the order defined (giver)


@dataclass(frozen=True)
class Facts:
    """What the passes of one fuse found, for the passes after them and for the report: the
    blocks before recognition and the log of each (Recognise), the form each fused block
    got (the lowering, then FoldRotary), where packed weights went (FoldRotary,
    PackKernelInputs), the KV interface (past -> present pairs, a shared cache's row
    layout and layer count: LowerToOrt; its past length read from the shapes: Guards) and
    the cache record (RecordCache). ``given``: the fields some pass has set."""

    before: tuple = ()
    blog: BlockLog = field(default_factory=BlockLog)
    chosen: Mapping[str, Form] = field(default_factory=dict)
    packed: Mapping[str, tuple[str, int, int]] = field(default_factory=dict)
    rotating: Folded = field(default_factory=lambda: Folded({}))
    pairs: Mapping[str, str] = field(default_factory=dict)
    rows: Any = None
    shared: int = 0
    from_shapes: bool = False
    cache: Mapping | None = None
    given: frozenset[str] = frozenset()

    @classmethod
    def known(cls, **values: Any) -> Facts:
        """Facts given by hand (a pass run alone on a model already lowered, in tests)."""
        return cls(**values, given=frozenset(values))

    def add(self, new: Mapping[str, Any]) -> Facts:
        return replace(self, **new, given=self.given | frozenset(new))


@dataclass
class FusionResult(ir.passes.PassResult):
    """A pass's answer: onnx-ir's (the model, whether it changed) with what it counted, the
    notes users read in the fuse report, and the facts with the ones it gave."""

    counts: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    facts: Facts = field(default_factory=Facts)


class FusionPass(ir.passes.InPlacePass):
    """A stage of fuse: ``apply`` rewrites the model and returns what it did, by name
    (counts), and the facts it found (their names in ``GIVES``); ``NOTES`` renders the counts
    that users read. ``TARGETS``/``EPS``: the targets and execution providers whose list it
    is on; ``NEEDS``: the facts an earlier pass must have given."""

    TARGETS: tuple[str, ...] = ("ort", "onnx")
    EPS: tuple[str, ...] | None = None  # None: any
    NEEDS: tuple[str, ...] = ()
    GIVES: tuple[str, ...] = ()
    NOTES: dict[str, str] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _KINDS.append(cls)

    def __init__(self, policy: FormPolicy | None = None, facts: Facts | None = None, *,
                 floors: Mapping | None = None) -> None:
        super().__init__()
        self.policy = policy or FormPolicy()
        self.facts = facts or Facts()
        self.floors = dict(floors or {})  # the least value of each dim (recognition's)
        self.result: FusionResult | None = None

    @property
    def target(self) -> str:  # the lowering: "ort" or "onnx" (OpenVINO's is onnx's)
        return self.policy.lowering

    def requires(self, model: ir.Model) -> None:
        name = type(self).__name__
        if self.target not in self.TARGETS or (
                self.EPS is not None and self.policy.ep not in self.EPS):
            raise ir.passes.PreconditionError(
                f"{name} is a pass for target(s) {', '.join(self.TARGETS)}"
                + (f" on {', '.join(self.EPS)}" if self.EPS else "")
                + f", not {self.target} on {self.policy.ep}")
        missing = [fact for fact in self.NEEDS if fact not in self.facts.given]
        if missing:
            raise ir.passes.PreconditionError(
                f"{name} needs {', '.join(missing)} from an earlier pass "
                f"({', '.join(sorted({giver(fact) for fact in missing}))})")

    def call(self, model: ir.Model) -> FusionResult:
        counts, found = self.apply(model)
        self.result = FusionResult(model, any(bool(v) for v in counts.values()), counts,
                                   tuple(self.notes(counts, found)), self.facts.add(found))
        return self.result

    def ensures(self, model: ir.Model) -> None:
        assert self.result is not None
        unsaid = set(self.GIVES) - set(self.result.facts.given)
        if unsaid:
            raise ir.passes.PostconditionError(
                f"{type(self).__name__} did not give {', '.join(sorted(unsaid))}")

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        raise NotImplementedError

    def notes(self, counts: Mapping[str, int], found: Mapping[str, Any]) -> list[str]:
        return [self.NOTES[k].format(n=v) for k, v in counts.items()
                if v and k in self.NOTES]


def giver(fact: str) -> str:
    """The first pass defined that gives ``fact``."""
    return next((kind.__name__ for kind in _KINDS if fact in kind.GIVES), "none")
