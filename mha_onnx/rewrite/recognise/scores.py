"""Recognisers for the parts of an attention core other than its mask.

Walking up from ``MatMul(probs, V)``: the probabilities tail (Softmax, then Cast, Dropout or a
NaN guard), the score chain (Softmax <- masks <- soft-cap <- scale <- Q·K^T), the scale, the
form K arrives in and grouped K/V are keys.py's. Each recogniser returns a small frozen
meaning or raises :class:`Reject` with the reason.

Dims: B batch, H query heads, G K/V heads, S query length, T key length, D head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.blocks import PROBS_OPS
from mha_onnx.rewrite.irutil import (
    WALK_LIMIT,
    const_fill,
    const_scalar,
    dims,
    producer,
    same_dim,
)
from mha_onnx.rewrite.recognise.attention_sinks import drops_last_column, max_shifted, sink_concat
from mha_onnx.rewrite.recognise.factors import head_factor, scalar_factor
from mha_onnx.rewrite.recognise.masks import Term


class Reject(Exception):
    """A candidate that is not fused: ``block`` (its Softmax) and ``reason`` as fields.
    ``candidate`` is False when the MatMul is not attention at all (nothing to report)."""

    def __init__(self, block: str, reason: str, *, candidate: bool = True) -> None:
        super().__init__(f"{block}: {reason}" if block else reason)
        self.block = block
        self.reason = reason
        self.candidate = candidate


@dataclass(frozen=True)
class ProbsTail:
    """Softmax -> (NaN guard | Cast | Dropout | Identity)* -> MatMul(., V); ``merged``: the
    heads a Reshape [B, H, S, T] -> [B*H, S, T] folded into the batch on the way (0: none)."""

    softmax: ir.Node
    nodes: tuple[ir.Node, ...]  # from the MatMul with V up to the Softmax
    nan_to_zero: bool
    merged: int = 0
    sliced: bool = False  # the last column (an attention sink's) dropped (rewrite/recognise/attention_sinks.py)
    # [B, H, S, T] scores the Softmax saw merged to [B*H, S, T], its output split back and
    # merged again on the way to V (XGLM): the block reads as a Softmax over them
    unmerged: ir.Value | None = None

    @property
    def block(self) -> str:
        return self.softmax.name or "softmax"

    @property
    def scores(self) -> ir.Value:
        """The Softmax's input, in [B, H, S, T] where it was merged only for the Softmax."""
        return self.unmerged if self.unmerged is not None else self.softmax.inputs[0]


def _nan_guard(node: ir.Node) -> bool:
    """``Where(IsNaN(x), 0, x)``."""
    if node.op_type != "Where" or const_scalar(node.inputs[1]) != 0.0:
        return False
    isnan = producer(node.inputs[0], "IsNaN")
    return isnan is not None and isnan.inputs[0] is node.inputs[2]


def heads_merged(node: ir.Node) -> int:
    """For ``Reshape([B, H, S, T] -> [B*H, S, T])``: H (static); else 0."""
    src, out = dims(node.inputs[0]), dims(node.outputs[0])
    if node.op_type != "Reshape" or src is None or out is None or len(src) != 4 or len(out) != 3:
        return 0
    fits = isinstance(src[1], int) and same_dim(out[1], src[2]) and same_dim(out[2], src[3])
    return int(src[1]) if fits else 0


def heads_split(node: ir.Node) -> int:
    """For ``Reshape([B*H, S, T] -> [B, H, S, T])``: H (static); else 0."""
    if node.op_type != "Reshape":  # (a Constant node has no input to read)
        return 0
    src, out = dims(node.inputs[0]), dims(node.outputs[0])
    if src is None or out is None or len(src) != 3 or len(out) != 4:
        return 0
    fits = isinstance(out[1], int) and same_dim(src[1], out[2]) and same_dim(src[2], out[3])
    return int(out[1]) if fits else 0


def probs_tail(matmul: ir.Node) -> ProbsTail:
    """The Softmax whose probabilities ``matmul`` multiplies with V."""
    chain: list[ir.Node] = [matmul]
    nan_to_zero, merged, sliced, round_trip = False, 0, False, False
    current = matmul.inputs[0]
    for _ in range(6):
        node = producer(current)
        if node is None:
            break
        if node.op_type == "Softmax":
            unmerged = _unmerged(node, merged) if round_trip else None
            tail = ProbsTail(node, tuple(chain + [node]), nan_to_zero, merged, sliced,
                             unmerged)
            _check_private(tail)
            return tail
        if merged and not round_trip and heads_split(node) == merged \
                and producer(node.inputs[0], "Softmax") is not None:
            round_trip = True  # [B*H, S, T] -> [B, H, S, T] -> [B*H, S, T]: the same tensor
            chain.append(node)
            current = node.inputs[0]
            continue
        if not sliced and drops_last_column(node):
            sliced = True
            chain.append(node)
            current = node.inputs[0]
            continue
        if not merged and heads_merged(node):
            merged = heads_merged(node)
            chain.append(node)
            current = node.inputs[0]
        elif _nan_guard(node):
            nan_to_zero = True
            chain += [node, producer(node.inputs[0])]  # type: ignore[list-item]
            current = node.inputs[2]
        elif node.op_type in PROBS_OPS:
            chain.append(node)
            current = node.inputs[0]
        else:
            break
    raise Reject("", "not attention: the MatMul's left input is not a Softmax", candidate=False)


def _unmerged(softmax: ir.Node, heads: int) -> ir.Value:
    """The [B, H, S, T] scores a Softmax over [B*H, S, T] read (its input a Reshape merging
    ``heads``), for probabilities split back to [B, H, S, T] after it."""
    merge = producer(softmax.inputs[0], "Reshape")
    if merge is None or heads_merged(merge) != heads:
        raise Reject(softmax.name or "softmax", "the probabilities are split into heads "
                     "after the Softmax, but its scores were not merged from them")
    return merge.inputs[0]


def _check_private(tail: ProbsTail) -> None:
    """The probabilities must be used by this block only (else fusing removes nothing)."""
    inside = set(tail.nodes)
    for node in tail.nodes[1:]:
        for out in node.outputs:
            if out.is_graph_output() or any(user not in inside for user, _ in out.uses()):
                raise Reject(tail.block, "the attention weights are also used elsewhere (an "
                             "output or another node); fusing would not remove them")


# -- scale -------------------------------------------------------------------------------

# -- score chain -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ScoreChain:
    """Softmax input = softcap(pre · Q·K^T) + masks, with the scales folded:
    ``scale`` multiplies Q·K^T (inside the cap), ``terms`` are the masks met (each with the
    scale applied after it), ``softcap`` is c of ``c·tanh(x/c)`` (0: none)."""

    matmul: ir.Node
    terms: tuple[Term, ...]
    scale: float
    softcap: float = 0.0
    split: int = 0  # heads a Reshape [B*H, S, T] -> [B, H, S, T] split out on the way
    sink: ir.Value | None = None  # the sink column concatenated to the scores (attention_sinks.py)
    head_scale: np.ndarray | None = None  # [H] factors of Q·K^T, one per head (Swin-v2)
    floor: float | None = None  # Max(scores, floor): masked scores clamped (XGLM)


def reaches_matmul(value: ir.Value | None, depth: int = 0) -> bool:
    """Does ``value`` come from a MatMul through the ops allowed between Q·K^T and Softmax?"""
    node = producer(value)
    if node is None or depth > WALK_LIMIT:
        return False
    if node.op_type == "MatMul":
        return True
    if node.op_type in ("Mul", "Div"):
        found = (_softcap_inner(node) if node.op_type == "Mul" else None) \
            or scalar_factor(node) or head_factor(node)
        return found is not None and reaches_matmul(found[0], depth + 1)
    if node.op_type == "Add":
        return any(reaches_matmul(v, depth + 1) for v in node.inputs)
    if node.op_type == "Where":
        return reaches_matmul(node.inputs[1], depth + 1) or reaches_matmul(node.inputs[2], depth + 1)
    if node.op_type == "Cast" or heads_split(node):
        return reaches_matmul(node.inputs[0], depth + 1)
    return False


def _softcap_inner(node: ir.Node) -> tuple[ir.Value, float] | None:
    """``Mul(Tanh(x / c), c)`` (either operand order; the division as Mul by 1/c): (x, c)."""
    for tanh_out, c_value in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        cap = const_scalar(c_value)
        tanh = producer(tanh_out, "Tanh")
        if cap is None or cap <= 0 or tanh is None:
            continue
        inner = producer(tanh.inputs[0], "Mul", "Div")
        found = scalar_factor(inner) if inner is not None else None
        if found is not None and math.isclose(found[1] * cap, 1.0, rel_tol=1e-6):
            return found[0], cap
    return None


class _ChainWalk:
    """Mutable state of one walk from the Softmax input up to Q·K^T."""

    def __init__(self, block: str) -> None:
        self.block = block
        self.post = 1.0
        self.terms: list[Term] = []
        self.softcap = 0.0
        self.split = 0
        self.sink: ir.Value | None = None
        self.head_scale: np.ndarray | None = None
        self.floor: float | None = None
        self.first = True  # (a sink's Concat and the max shifted out come before any term)

    def step(self, node: ir.Node) -> ir.Value:
        """Consume ``node``; return the value to continue from."""
        op = node.op_type
        first, self.first = self.first, False
        if first and max_shifted(node) is not None:
            self.first = True
            return max_shifted(node)
        if first and self.sink is None and sink_concat(node) is not None:
            scores, self.sink = sink_concat(node)
            return scores
        if op in ("Mul", "Div"):
            capped = _softcap_inner(node) if op == "Mul" else None
            if capped is not None:
                return self._enter_cap(*capped)
            found = scalar_factor(node)
            if found is None and (per_head := head_factor(node)) is not None:
                return self._head_scale(*per_head)
            if found is None:
                raise Reject(self.block, f"scores are scaled by a non-constant or zero ({op})")
            self.post *= found[1]
            return found[0]
        if op == "Add":
            return self._add(node)
        if op == "Where":
            return self._where(node)
        if op == "Cast":
            return node.inputs[0]
        if op == "Max":
            return self._clamp(node)
        if not self.split and heads_split(node):  # terms above this are [B*H, ..] tensors
            self.split = heads_split(node)
            return node.inputs[0]
        if op == "Tanh":
            raise Reject(self.block, "a Tanh between Q·K^T and Softmax that is not a soft-cap "
                         "c·tanh(s/c)")
        raise Reject(self.block, f"{op} between Q·K^T and Softmax is not an attention pattern")

    def _clamp(self, node: ir.Node) -> ir.Value:
        """``Max(scores, c)`` with c at or below float16's lowest finite value: no score of a
        kept key is that low, so it only lifts masked scores to c (the fill, checked in
        core.py, must not be below it)."""
        if self.softcap or not math.isclose(self.post, 1.0, rel_tol=1e-6):
            raise Reject(self.block, "scores clamped inside a soft-cap or before a scale")
        for scores, bound in (node.inputs, node.inputs[::-1]):
            c = const_scalar(bound)
            if c is not None and c <= float(np.finfo(np.float16).min) \
                    and reaches_matmul(scores):
                self.floor = c if self.floor is None else max(self.floor, c)
                return scores
        raise Reject(self.block, "a Max between Q·K^T and Softmax that is not a clamp of the "
                     "masked scores (a constant at or below float16's lowest value)")

    def _head_scale(self, inner: ir.Value, factors: np.ndarray) -> ir.Value:
        """A factor per head on Q·K^T (Swin-v2's learned logit scale): terms met after it
        would be inside it, scaled per head, which the kernels' bias is not."""
        if self.softcap:
            raise Reject(self.block, "a scale per head inside a soft-cap")
        self.head_scale = factors if self.head_scale is None else self.head_scale * factors
        return inner

    def _enter_cap(self, inner: ir.Value, cap: float) -> ir.Value:
        if self.head_scale is not None:
            raise Reject(self.block, "a soft-cap inside a scale per head")
        if self.softcap:
            raise Reject(self.block, "two soft-caps on one score")
        if not math.isclose(self.post, 1.0, rel_tol=1e-6):
            raise Reject(self.block, "capped scores are scaled again after the cap")
        self.softcap = cap
        return inner

    def _add(self, node: ir.Node) -> ir.Value:
        a, b = node.inputs
        ra, rb = reaches_matmul(a), reaches_matmul(b)
        if ra == rb:
            raise Reject(self.block, "cannot tell scores from mask in an Add")
        self._no_mask_inside_cap()
        scores, bias = (a, b) if ra else (b, a)
        self.terms.append(Term("add", bias, self.post, lift=self.split))
        return scores

    def _where(self, node: ir.Node) -> ir.Value:
        cond, a, b = node.inputs
        fa, fb = const_fill(a), const_fill(b)
        self._no_mask_inside_cap()
        if fa is not None and fb is None and reaches_matmul(b):
            self.terms.append(Term("replace", cond, self.post, fill=fa, masked_when=True,
                                   lift=self.split))
            return b
        if fb is not None and fa is None and reaches_matmul(a):
            self.terms.append(Term("replace", cond, self.post, fill=fb, masked_when=False,
                                   lift=self.split))
            return a
        raise Reject(self.block, "a Where between Q·K^T and Softmax is not a masked fill")

    def _no_mask_inside_cap(self) -> None:
        if self.softcap:
            raise Reject(self.block, "a mask inside the soft-cap (applied before tanh)")
        if self.head_scale is not None:
            raise Reject(self.block, "a mask inside a scale per head (scaled with the scores)")


def score_chain(softmax: ir.Node, block: str, scores: ir.Value | None = None) -> ScoreChain:
    """Walk from the Softmax input (``scores``: ProbsTail.scores) up to Q·K^T, collecting
    scale, soft-cap and mask terms."""
    walk = _ChainWalk(block)
    current = scores if scores is not None else softmax.inputs[0]
    for _ in range(WALK_LIMIT):
        node = producer(current)
        if node is None:
            break
        if node.op_type == "MatMul":
            # with a cap, the factors met before it were 1; walk.post holds those inside it
            return ScoreChain(node, tuple(walk.terms), walk.post, walk.softcap, walk.split,
                              walk.sink, walk.head_scale, walk.floor)
        current = walk.step(node)
    raise Reject(block, "the Softmax input does not come from Q·K^T")
