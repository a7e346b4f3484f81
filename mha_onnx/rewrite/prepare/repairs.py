"""Repairs of ops that ONNX Runtime 1.31 refuses as exporters write them, so that the graph
(fused or not) runs at all; each is verified like any rewrite.

- ``RotaryEmbedding`` (opset 23) without position ids: torch writes cos/sin caches of shape
  [1, S, D/2] (broadcast over the batch, as the spec's function body allows); ORT's kernel
  wants [B, S, D/2] exactly. The caches are expanded over the batch.
"""

from __future__ import annotations

from onnxscript.rewriter import MatchResult, pattern

from mha_onnx.rewrite.irutil import dims, same_dim


class RotaryCachesOverBatch(pattern.RewriteRuleClassBase):
    """RotaryEmbedding(x, cos [1, S, D/2], sin [1, S, D/2]) -> caches expanded to [B, S, D/2]."""

    def __init__(self, repaired: list[str]) -> None:
        super().__init__("RotaryCachesOverBatch")
        self.repaired = repaired

    def pattern(self, op, x, cos, sin):
        return op.RotaryEmbedding(x, cos, sin, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, x, cos, sin, out, **_):
        result = MatchResult()
        xd, cd, sd = dims(x), dims(cos), dims(sin)
        if xd is None or cd is None or sd is None or len(cd) != 3 or len(sd) != 3:
            return result.fail("caches are not 3-D (position ids given, or shapes unknown)")
        if same_dim(cd[0], xd[0]) and same_dim(sd[0], xd[0]):
            return result.fail("caches already have the batch dim")
        if cd[0] != 1 or sd[0] != 1:
            return result.fail("caches neither per batch entry nor broadcast over it")
        return result

    def rewrite(self, op, x, cos, sin, out, **_):
        node = out.producer()
        self.repaired.append(node.name or "RotaryEmbedding")
        target = op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[1, 1]), axis=0)
        attrs = {name: attr.value for name, attr in node.attributes.items()}
        return op.RotaryEmbedding(x, op.Expand(cos, target), op.Expand(sin, target), **attrs)
