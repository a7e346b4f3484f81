"""validate's PyTorch reference takes the ONNX model's routes (parity/held.py): a near-tied
router that the two round apart is not a mismatch, a reference whose top-k calls do not
fit the graph's runs as it is, and torch.topk is itself again afterwards."""

from __future__ import annotations

import numpy as np
import torch
from onnx import numpy_helper

from mha_onnx.parity.held import HeldReference, Routed, router_indices, with_router_outputs
from mha_onnx.runtime.ort import OrtRunner
from mha_onnx.stats import compare
from tests.rewrite.test_routes import _moe

REAL = (torch.topk, torch.Tensor.topk)


class _Torch:
    """The same mixture as _moe() in PyTorch (float64, no shift): ``calls`` top-k per run."""

    def __init__(self, model, calls: int = 1) -> None:
        weights = {i.name: torch.from_numpy(numpy_helper.to_array(i).astype(np.float64))
                   for i in model.graph.initializer}
        self.w, self.calls = weights, calls

    def infer(self, feeds):
        x = torch.from_numpy(feeds["x"].astype(np.float64))
        raw = x @ self.w["router"]
        for _ in range(self.calls - 1):
            torch.topk(raw, 2, dim=-1)  # a call the graph has no TopK for
        weight, choice = torch.topk(raw, 1, dim=-1)
        picked = torch.where(choice == 0, x @ self.w["w0"], x @ self.w["w1"])
        return {"y": (picked * weight).numpy().astype(np.float32)}


def _runs(calls: int = 1):
    model = _moe(score_shift=3e-6)  # the ONNX model rounds the near-tie the other way
    names = router_indices(model)
    runner = Routed(OrtRunner(with_router_outputs(model, names), "cpu"), names, ["y"])
    reference = _Torch(model, calls)
    feeds = {"x": np.random.default_rng(0).normal(size=(2, 16, 8)).astype(np.float32)}
    return runner, reference, feeds


def test_the_reference_takes_the_graphs_routes() -> None:
    runner, reference, feeds = _runs()
    got = runner.infer(feeds)
    assert list(got) == ["y"] and runner.routes[0].shape == (2, 16, 1)
    assert not compare(got["y"], reference.infer(feeds)["y"]).passed  # routes flipped
    held = HeldReference(reference, runner)
    assert compare(got["y"], held.infer(feeds)["y"]).passed
    assert (held.held, held.unheld) == (1, 0)
    assert (torch.topk, torch.Tensor.topk) == REAL


def test_calls_that_do_not_fit_run_unheld() -> None:
    runner, reference, feeds = _runs(calls=2)
    runner.infer(feeds)
    held = HeldReference(reference, runner)
    want = held.infer(feeds)
    assert (held.held, held.unheld) == (0, 1)
    np.testing.assert_array_equal(want["y"], reference.infer(feeds)["y"])
    assert (torch.topk, torch.Tensor.topk) == REAL
