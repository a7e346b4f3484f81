"""A mixture of experts validated against PyTorch with PyTorch's routes held to the ONNX
model's (issue 42, class 1; rewrite/check/routes.py holds them the same way in fuse's check).

A router's top-k over near-tied scores flips under any change of arithmetic (a float16
model against the float32 PyTorch reference, one provider against another), the token then
runs through another expert, and an output differs by far more than any tolerance although
nothing is wrong. So the runtime under test runs the file as it is, with its routers'
chosen indices added to its outputs, and the PyTorch reference then takes those indices in
place of its own ``topk`` (their scores gathered from its own router): whatever still
differs is the model's. The routers are matched in order: the n-th TopK of the ONNX main
graph is the n-th ``topk`` PyTorch calls in a forward (an export keeps the program order);
a call that does not fit (another count, shape or a smallest-k) runs PyTorch unheld.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx

from mha_onnx.graph.light import model_bytes
from mha_onnx.rewrite.check.routes import chosen_values, indices_as_outputs


def router_indices(model: onnx.ModelProto) -> list[str]:
    """The chosen-indices values of the main graph's TopK nodes, in graph order (PyTorch's
    ``topk`` is what can be held)."""
    return chosen_values(model, ("TopK",))


def routed_source(model: onnx.ModelProto, references: dict) -> tuple[list[str], bytes | None]:
    """The routers to hold and the model to run for them (with_router_outputs), where a
    PyTorch reference can take them; ([], None) otherwise."""
    routers = router_indices(model) if "pytorch" in references else []
    source = with_router_outputs(model, routers) if routers else None
    return (routers, source) if source is not None else ([], None)


def with_router_outputs(model: onnx.ModelProto, names: Sequence[str]) -> bytes | None:
    """The serialized model with ``names`` added to its outputs (the proto is put back);
    None past protobuf's 2 GB (its weights inline): then nothing is held."""
    if model_bytes(model) >= (1 << 31) - (1 << 20):
        return None
    with indices_as_outputs(model, list(names)):
        return model.SerializeToString()


def hold_routes(runners: dict, references: dict, routers: Sequence[str], kept: Sequence[str]
                ) -> HeldReference | None:
    """With ``routers``: the first provider's runner (made from with_router_outputs) gives
    their indices, and the PyTorch reference takes them; that HeldReference, or None.
    ``kept``: the model's own outputs."""
    if not routers or not runners or "pytorch" not in references:
        return None
    first = next(iter(runners))
    runners[first] = Routed(runners[first], routers, kept)
    references["pytorch"] = HeldReference(references["pytorch"], runners[first])
    return references["pytorch"]


def held_note(held: HeldReference | None, runners: dict) -> tuple[str, ...]:
    """What the report says of the held routes."""
    if held is None:
        return ()
    first = next(iter(runners))
    said = (f"PyTorch's routers (top-k) held to the ONNX model's choice on {first} in "
            f"{held.held} run(s), so that a near-tie rounded the other way is not a mismatch")
    if held.unheld:
        said += f"; not in {held.unheld} (PyTorch's top-k calls did not match the graph's)"
    return (said + (f"; the other providers are compared with it as routed on {first}"
                    if len(runners) > 1 else ""),)


class Routed:
    """A runner of the model with its routers' indices as extra outputs: gives the model's
    own outputs and keeps the indices of its last run (``routes``)."""

    def __init__(self, runner: Any, names: Sequence[str], kept: Sequence[str]) -> None:
        self.runner, self.names, self.kept = runner, list(names), set(kept)
        self.routes: list[np.ndarray] = []

    def infer(self, feeds):
        out = self.runner.infer(feeds)
        self.routes = [out[name] for name in self.names]
        return {k: v for k, v in out.items() if k not in self.names or k in self.kept}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class HeldReference:
    """A PyTorch reference whose ``topk`` calls take ``source``'s last routes; ``held`` and
    ``unheld`` count the runs each way."""

    def __init__(self, reference: Any, source: Routed) -> None:
        self.reference, self.source = reference, source
        self.held = self.unheld = 0

    def infer(self, feeds):
        try:
            with _held_topk(self.source.routes):
                out = self.reference.infer(feeds)
            self.held += 1
            return out
        except _NotHeld:
            self.unheld += 1
            return self.reference.infer(feeds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reference, name)


class _NotHeld(Exception):
    pass


@contextmanager
def _held_topk(routes: Sequence[np.ndarray]) -> Iterator[None]:
    """``torch.topk`` and ``Tensor.topk`` answer with ``routes`` in turn while inside; every
    one must be taken, each by a call of its shape (else _NotHeld)."""
    import torch

    queue = list(routes)
    real_function, real_method = torch.topk, torch.Tensor.topk

    def held(values, k, dim=-1, largest=True, sorted=True, **kwargs):  # noqa: A002
        if not queue or not largest or kwargs:
            raise _NotHeld
        chosen = torch.from_numpy(np.ascontiguousarray(queue.pop(0))).to(values.device)
        expected = list(values.shape)
        expected[dim] = int(k)
        if list(chosen.shape) != expected or chosen.dtype != torch.int64:
            raise _NotHeld
        return torch.return_types.topk((values.gather(dim, chosen), chosen))

    torch.topk = held
    torch.Tensor.topk = held
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = real_function, real_method
    if queue:
        raise _NotHeld
