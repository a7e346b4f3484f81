"""shared_probs: one Softmax's weights applied to several value tensors become one MatMul
over the values concatenated, split after (exact); near misses are left alone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from mha_onnx.rewrite.prepare.shared_probs import merge_value_matmuls
from tests.irgraphs import F, model, node, tensor


def _graph(second_shape, swapped=False):
    nodes = [node("Softmax", ["s"], "p", axis=-1),
             node("MatMul", ["p", "v1"], "o1"),
             node("MatMul", ["v2", "p"] if swapped else ["p", "v2"], "o2"),
             node("Sub", ["o1", "o2"], "y")]
    inputs = [tensor("s", F, ["B", 2, 5, 5]), tensor("v1", F, ["B", 2, 5, 4]),
              tensor("v2", F, second_shape)]
    return model(nodes, inputs, ["y"], out_types={"y": (F, ["B", 2, 5, 4])})


def test_two_value_halves_become_one_matmul_with_the_same_result():
    proto = _graph(["B", 2, 5, 4])
    graph = ir.from_proto(proto)
    assert merge_value_matmuls(graph) == 1
    assert [n.op_type for n in graph.graph].count("MatMul") == 1
    rng = np.random.default_rng(0)
    feeds = {"s": rng.standard_normal((3, 2, 5, 5)).astype(np.float32),
             "v1": rng.standard_normal((3, 2, 5, 4)).astype(np.float32),
             "v2": rng.standard_normal((3, 2, 5, 4)).astype(np.float32)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0] for m in (proto, ir.to_proto(graph))]
    np.testing.assert_allclose(run[1], run[0], atol=1e-6)


@pytest.mark.parametrize("second_shape, swapped", [(["B", 2, 5, 4], True),
                                                   (["B", 3, 5, 4], False),
                                                   (["B", 2, 5, "D"], False)],
                         ids=["weights-second", "other-heads", "symbolic-value-dim"])
def test_near_misses_are_left(second_shape, swapped):
    graph = ir.from_proto(_graph(second_shape, swapped))
    assert merge_value_matmuls(graph) == 0
    assert [n.op_type for n in graph.graph].count("MatMul") == 2


def test_weights_combined_before_v_become_one_attention_per_softmax():
    """(P1 - lambda P2) @ V == P1 @ V - (P2 @ V) lambda, lambda per head [H, 1, 1]."""
    from mha_onnx.rewrite.prepare.shared_probs import distribute_combinations
    from tests.irgraphs import const

    nodes = [node("Softmax", ["s1"], "p1", axis=-1), node("Softmax", ["s2"], "p2", axis=-1),
             const("lam", np.array([[[0.3]], [[0.7]]], np.float32)),
             node("Mul", ["lam", "p2"], "lp2"), node("Sub", ["p1", "lp2"], "w"),
             node("MatMul", ["w", "v"], "y")]
    inputs = [tensor("s1", F, ["B", 2, 5, 5]), tensor("s2", F, ["B", 2, 5, 5]),
              tensor("v", F, ["B", 2, 5, 4])]
    proto = model(nodes, inputs, ["y"], out_types={"y": (F, ["B", 2, 5, 4])})
    graph = ir.from_proto(proto)
    assert distribute_combinations(graph) == 1
    matmuls = [n for n in graph.graph if n.op_type == "MatMul"]
    assert sorted(n.inputs[0].producer().op_type for n in matmuls) == ["Softmax", "Softmax"]
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in
             (("s1", (3, 2, 5, 5)), ("s2", (3, 2, 5, 5)), ("v", (3, 2, 5, 4)))}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0] for m in (proto, ir.to_proto(graph))]
    np.testing.assert_allclose(run[1], run[0], atol=1e-6)


@pytest.mark.slow
def test_the_papers_differential_attention_exported_by_torch_fuses_both_softmaxes(tmp_path):
    """(P1 - lambda P2) @ V written in PyTorch (two Softmaxes, a per-head lambda), through
    torch.export: both blocks fused and verified."""
    import onnx
    import torch

    from mha_onnx.rewrite import fuse_file
    from tests.models import batch_seq_dims, export

    class Diff(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64)
            self.v = torch.nn.Linear(32, 32)
            self.lam = torch.nn.Parameter(torch.full((4, 1, 1), 0.4))

        def forward(self, x):
            b, n, _ = x.shape
            q = self.q(x).view(b, n, 4, 2, 8).permute(3, 0, 2, 1, 4)  # (2, B, H, S, 8)
            k = self.k(x).view(b, n, 4, 2, 8).permute(3, 0, 2, 1, 4)
            v = self.v(x).view(b, n, 4, 8).transpose(1, 2)
            p1 = torch.softmax(q[0] @ k[0].transpose(-1, -2) / 8 ** 0.5, -1)
            p2 = torch.softmax(q[1] @ k[1].transpose(-1, -2) / 8 ** 0.5, -1)
            return ((p1 - self.lam * p2) @ v).transpose(1, 2).reshape(b, n, 32)

    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    onnx.save(export(Diff().eval(), (torch.randn(2, 6, 32),), {"x": {0: batch, 1: seq}},
                     opset=18, names=["x"]), tmp_path / "diff.onnx")
    report = fuse_file(tmp_path / "diff.onnx", tmp_path / "fused.onnx")
    assert [b.status for b in report.blocks] == ["fused", "fused"], report.render()
    assert report.verification.passed
