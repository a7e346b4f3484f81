"""rewrite/prepare/windows.py: a window mask added on a [B, nW, H, N, N] view of the scores (or a mask on
DETR's [B, H, T, S] view of [B*H, T, S] scores) becomes a
bias on the scores themselves (Swin's shifted blocks), exactly; views that do not give the
scores' layout back are left."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxruntime as ort
import pytest
from onnxscript.rewriter import RewriteRuleSet

from mha_onnx.rewrite.prepare.windows import window_mask_rules
from tests.irgraphs import F, const, model, node, tensor

H, N, WINDOWS = 2, 4, 3


def _view(back: list[int], mask_heads: int = 1, first: int = 2, twice: bool = False
          ) -> onnx.ModelProto:
    """probs = Softmax(Reshape(Reshape(s, [first, nW, H, N, N]) + mask, back)); s [B*nW, H,
    N, N] from a MatMul, as in Swin (``twice``: the mask added twice, as Swin-v2 does)."""
    nodes = [node("MatMul", ["q", "kt"], "s"),
             const("v5", [first, WINDOWS, H, N, N]), node("Reshape", ["s", "v5"], "view"),
             *([node("Add", ["view", "mask"], "once"), node("Add", ["mask", "once"], "added")]
               if twice else [node("Add", ["view", "mask"], "added")]),
             const("v4", back), node("Reshape", ["added", "v4"], "scores"),
             node("Softmax", ["scores"], "probs", axis=-1)]
    return model(nodes, [tensor("q", F, [2 * WINDOWS, H, N, 8]),
                         tensor("kt", F, [2 * WINDOWS, H, 8, N]),
                         tensor("mask", F, [1, WINDOWS, mask_heads, N, N])], ["probs"])


def _run(proto: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _rewritten(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    found: list[str] = []
    graph = ir.from_proto(proto)
    common_passes.ShapeInferencePass()(graph)
    RewriteRuleSet(window_mask_rules(found)).apply_to_model(graph)
    common_passes.RemoveUnusedNodesPass()(graph)
    return ir.to_proto(graph), found


@pytest.mark.parametrize("mask_heads, twice, first", [(1, False, 2), (H, False, 2), (1, True, 2),
                                                     (1, False, -1)])
def test_a_mask_on_the_window_view_becomes_a_bias_on_the_scores(mask_heads, twice, first):
    """``first`` -1: the view as torch.export folds torchvision's and timm's
    ``view(B // nW, nW, ...)``; the bias's Expand gets the size Reshape infers."""
    proto = _view([-1, H, N, N], mask_heads, first=first, twice=twice)
    out, found = _rewritten(proto)
    assert len(found) == 1
    assert not [n for n in out.graph.node if n.op_type == "Reshape"
                and n.output[0] in ("view",)], "the 5-D view of the scores is gone"
    softmax = next(n for n in out.graph.node if n.op_type == "Softmax")
    add = next(n for n in out.graph.node if softmax.input[0] in n.output)
    assert add.op_type == "Add"  # scores + bias (+ bias), the recogniser's form
    assert sum(n.op_type == "Add" for n in out.graph.node) == (2 if twice else 1)
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((2 * WINDOWS, H, N, 8)).astype(np.float32),
             "kt": rng.standard_normal((2 * WINDOWS, H, 8, N)).astype(np.float32),
             "mask": np.where(rng.random((1, WINDOWS, mask_heads, N, N)) < 0.3, -100.0,
                              0.0).astype(np.float32)}
    np.testing.assert_array_equal(_run(out, feeds), _run(proto, feeds))


@pytest.mark.parametrize("back, first", [
    ([-1, N, H, N], 2),   # back with heads and lengths swapped: not the scores' layout
    ([-1, H, N, N], 0),   # a view that copies a dim (0): not sizes to expand the mask to
])
def test_a_view_that_does_not_give_the_scores_back_is_left(back, first):
    out, found = _rewritten(_view(back, first=first))
    assert not found
    assert sum(n.op_type == "Reshape" for n in out.graph.node) == 2


def _view_of_3d(back: list[int]) -> onnx.ModelProto:
    """DETR's form: scores [B*H, T, S] viewed as [B, H, T, S], a pixel mask [B, 1, 1, S]
    added, and viewed back."""
    nodes = [node("MatMul", ["q", "kt"], "s"), const("v4", [2, H, N, N + 1]),
             node("Reshape", ["s", "v4"], "view"), node("Add", ["view", "mask"], "added"),
             const("v3", back), node("Reshape", ["added", "v3"], "scores"),
             node("Softmax", ["scores"], "probs", axis=-1)]
    return model(nodes, [tensor("q", F, [2 * H, N, 8]), tensor("kt", F, [2 * H, 8, N + 1]),
                         tensor("mask", F, [2, 1, 1, N + 1])], ["probs"])


def test_a_mask_on_a_view_of_3d_scores_becomes_a_bias_on_them():
    proto = _view_of_3d([2 * H, N, N + 1])
    out, found = _rewritten(proto)
    assert len(found) == 1
    assert not [n for n in out.graph.node if "view" in n.output], "the 4-D view is gone"
    rng = np.random.default_rng(1)
    feeds = {"q": rng.standard_normal((2 * H, N, 8)).astype(np.float32),
             "kt": rng.standard_normal((2 * H, 8, N + 1)).astype(np.float32),
             "mask": np.where(rng.random((2, 1, 1, N + 1)) < 0.4, -1e4, 0.0).astype(np.float32)}
    np.testing.assert_array_equal(_run(out, feeds), _run(proto, feeds))
    # back as [B*H, S, T]: not the scores' layout, left
    assert not _rewritten(_view_of_3d([2 * H, N + 1, N]))[1]


def test_a_shifted_window_block_as_torch_export_writes_it_fuses():
    """torchvision's shifted_window_attention as torch.export folds it: scores [b*nW, H, N, N]
    (b symbolic), the window mask [nW, N, N] (constant, -100 across windows' regions) added
    on a ``[-1, nW, H, N, N]`` view; the whole block fused, verified at several batches."""
    from mha_onnx.rewrite.check.verify import verify
    from mha_onnx.rewrite.fuse import fuse_model

    rng = np.random.default_rng(2)
    mask = np.where(rng.random((WINDOWS, N, N)) < 0.4, -100.0, 0.0).astype(np.float32)
    nodes = [node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]),
             node("MatMul", ["q", "kt"], "s"),
             const("v5", [-1, WINDOWS, H, N, N]), node("Reshape", ["s", "v5"], "view"),
             const("ax", [0, 2]), node("Unsqueeze", ["mask", "ax"], "mask5"),
             node("Add", ["view", "mask5"], "added"),
             const("v4", [-1, H, N, N]), node("Reshape", ["added", "v4"], "scores"),
             node("Softmax", ["scores"], "probs", axis=-1), node("MatMul", ["probs", "v"], "out")]
    proto = model(nodes, [tensor(x, F, ["bw", H, N, 8]) for x in "qkv"], ["out"],
                  out_types={"out": (F, ["bw", H, N, 8])})
    proto.graph.initializer.append(onnx.numpy_helper.from_array(mask, "mask"))
    fused, blocks, _ = fuse_model(proto)
    assert [b.status for b in blocks] == ["fused"], [b.reason for b in blocks]
    assert not [n for n in fused.graph.node if n.op_type == "Softmax"]
    feeds = [{x: rng.standard_normal((WINDOWS * b, H, N, 8)).astype(np.float32) for x in "qkv"}
             for b in (1, 3)]
    for given in feeds:
        assert verify(proto, fused, given=given).passed
