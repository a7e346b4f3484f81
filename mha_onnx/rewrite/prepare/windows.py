"""Shifted-window masks added on a view of the scores, made a bias on the scores themselves.

Swin (and its kin: Swin-v2, Donut's encoder, MaskFormer's backbone) attends inside windows of
N patches, the windows of every image stacked on the batch: scores ``s`` [B*nW, H, N, N]. Its
shifted blocks add the windows' mask [nW, N, N] on a view that splits the batch again::

    y = Reshape(Reshape(s, [B, nW, H, N, N]) + mask[None, :, None], [-1, H, N, N])

which no attention kernel takes as it stands. Reshapes only move elements row-major, so while
``y`` has ``s``'s shape, ``y = s + Reshape(Expand(mask, [B, nW, H, N, N]), [-1, H, N, N])``
element by element (``0 + m`` is ``m`` exactly): an additive bias on ``s`` computed from the
mask and the view's shapes alone, which the recogniser then reads as any dense bias ([B*nW,
1, N, N] where the mask is one for every head, as Swin's is). A view
whose round trip does not give back ``s``'s shape gives a different graph, which
verification refuses as it refuses any rewrite that changes a value.

The same holds one rank down: DETR (and the BART-style attention of its kin: Table
Transformer, Conditional DETR) keeps scores as [B*H, T, S] and adds the pixel mask on a
[B, H, T, S] view; the bias is then the mask expanded over that view, [B*H, T, S].
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, pattern

from mha_onnx.rewrite.irutil import const_ints, dims, producer, same_dim


class WindowMaskOnView(pattern.RewriteRuleClassBase):
    """``Reshape(Reshape(s, shape5) + m1 (+ m2 ...), shape4)`` before a Softmax ->
    ``s + bias1 (+ bias2 ...)``, the masks added in the original's order (Swin-v2 adds its
    window mask twice)."""

    def __init__(self, found: list[str]) -> None:
        super().__init__("WindowMaskOnView")
        self.found = found
        self._view: ir.Node | None = None
        self._masks: list[ir.Value] = []

    def pattern(self, op, added, shape4):
        return op.Reshape(added, shape4, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, added, shape4, out, **_) -> MatchResult:
        result = MatchResult()
        if not any(u.op_type == "Softmax" for u, _ in out.uses()):
            return result.fail("not before a Softmax")
        found = _view_and_masks(added)
        if found is None:
            return result.fail("not masks added on a 5-D view of 4-D scores")
        view, masks = found
        s, shape5 = view.inputs[0], view.inputs[1]
        sd, od, s5, s4 = dims(s), dims(out), dims(shape5), dims(shape4)
        if sd is None or od is None or len(sd) not in (3, 4) or s5 != [len(sd) + 1] \
                or s4 != [len(sd)]:
            return result.fail("not 3-D or 4-D scores viewed with one more axis and back")
        if not all(same_dim(a, b) for a, b in zip(sd[1:], od[1:], strict=True)):
            return result.fail("the view's round trip does not keep the heads and lengths")
        if not _sizes(shape5):
            return result.fail("the view's shape has a 0 or more than one -1")
        if any(_reads(v, s) for v in (shape5, shape4, *masks)):
            return result.fail("the view's shapes or the masks are computed from the scores")
        self._view, self._masks = view, masks
        return result

    def rewrite(self, op, added, shape4, out, **_):
        self.found.append(out.producer().name or "Reshape")
        s, shape5 = self._view.inputs[0], self._view.inputs[1]
        if not _sizes(shape5, inferred=False):
            shape5 = _inferred(op, shape5, s)
        total = s
        for mask in self._masks:
            total = op.Add(total, _bias(op, mask, shape5, shape4))
        return total


def _view_and_masks(value: ir.Value, depth: int = 4) -> tuple[ir.Node, list[ir.Value]] | None:
    """The view ``Reshape(s, shape5)`` under a chain of Adds and the masks the chain adds,
    innermost first."""
    node = value.producer()
    if node is None or depth == 0:
        return None
    if node.op_type == "Reshape" and node.domain in ("", "ai.onnx"):
        return node, []
    if node.op_type != "Add" or node.domain not in ("", "ai.onnx"):
        return None
    for inner, mask in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        below = _view_and_masks(inner, depth - 1)
        if below is not None and len(dims(below[0].inputs[0]) or []) in (3, 4):
            return below[0], [*below[1], mask]
    return None


def _bias(op, mask: ir.Value, shape5: ir.Value, shape4: ir.Value) -> ir.Value:
    """``mask`` expanded over the view and brought to the scores' layout; [B*nW, 1, N, N]
    where the mask is one for every head, broadcast over the heads as the view's Add
    broadcast it."""
    md = dims(mask)
    if md is not None and len(md) == 5 and md[2] == 1:
        one = op.Constant(value_ints=[1])
        shape5 = op.Concat(op.Slice(shape5, op.Constant(value_ints=[0]),
                                    op.Constant(value_ints=[2])), one,
                           op.Slice(shape5, op.Constant(value_ints=[3]),
                                    op.Constant(value_ints=[5])), axis=0)
        shape4 = op.Concat(op.Slice(shape4, op.Constant(value_ints=[0]), one), one,
                           op.Slice(shape4, op.Constant(value_ints=[2]),
                                    op.Constant(value_ints=[4])), axis=0)
    return op.Reshape(op.Expand(mask, shape5), shape4)


def _sizes(shape: ir.Value, inferred: bool = True) -> bool:
    """Is ``shape`` made of sizes only (no Reshape 0 among its constant parts, and no -1
    unless ``inferred``, then at most one: torch.export folds ``view(B // nW, nW, ...)`` to
    ``[-1, nW, ...]``; ``_inferred`` gives it its size)?"""
    whole = const_ints(shape)
    if whole is None:
        concat = producer(shape, "Concat")
        if concat is None:
            return False
        parts = [const_ints(part) for part in concat.inputs]
        whole = [d for part in parts if part is not None for d in part]
    return all(d > 0 or (inferred and d == -1) for d in whole) and whole.count(-1) <= 1


def _inferred(op, shape: ir.Value, scores: ir.Value) -> ir.Value:
    """``shape`` with its -1 replaced by the size Reshape infers for it: the scores' element
    count over the product of the other dims (Expand takes no -1)."""
    minus_one = op.Constant(value_ints=[-1])
    unknown = op.Equal(shape, minus_one)
    others = op.ReduceProd(op.Where(unknown, op.Constant(value_ints=[1]), shape), keepdims=1)
    count = op.ReduceProd(op.Shape(scores), keepdims=1)
    return op.Where(unknown, op.Div(count, others), shape)


def _reads(value: ir.Value, target: ir.Value, limit: int = 400) -> bool:
    """Is ``value`` computed from ``target`` (through at most ``limit`` nodes)?"""
    stack, seen = [value], set()
    while stack and len(seen) < limit:
        current = stack.pop()
        if current is target:
            return True
        node = current.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(v for v in node.inputs if v is not None)
    return bool(stack)  # past the limit: assume it does


def window_mask_rules(found: list[str]) -> list:
    return [WindowMaskOnView.rule(found)]
