"""Stage 1: recognise attention cores and replace each by one internal op.

``MatMul(Softmax(mask(softcap(scale(Q·K^T)))), V)`` in its many spellings and the ONNX
``Attention`` op become ``mha_onnx.fusion.Sdpa`` (see :mod:`mha_onnx.rewrite.sdpa`), whose
attributes say everything the lowering needs: scale, heads and K/V heads, soft-cap, and the
mask's meaning. The recognisers live in :mod:`~mha_onnx.rewrite.recognise.scores` (everything but the
mask), :mod:`~mha_onnx.rewrite.recognise.masks` and :mod:`~mha_onnx.rewrite.recognise.oracle` (the mask); a
candidate that is not fused is logged with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, pattern

from mha_onnx.rewrite.irutil import FORM, dims, float_attr, int_attr, same_dim
from mha_onnx.rewrite.recognise.attention_sinks import sink_values
from mha_onnx.rewrite.recognise.factors import strip_scale
from mha_onnx.rewrite.recognise.keys import (
    broadcast_heads,
    key_dims,
    key_from_transposed,
    repeated_heads,
)
from mha_onnx.rewrite.recognise.masks import ABSORBING, ScoreDims, Term
from mha_onnx.rewrite.recognise.meaning import Causal, MaskMeaning, Unsupported, plan
from mha_onnx.rewrite.recognise.oracle import Oracle
from mha_onnx.rewrite.recognise.scores import Reject, probs_tail, score_chain
from mha_onnx.rewrite.sdpa import emit_sdpa

SUPPORTED_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


@dataclass
class BlockLog:
    """What happened to each attention block (keyed by its Softmax or Attention node)."""

    reasons: dict[str, str] = field(default_factory=dict)
    matched: dict[str, Core] = field(default_factory=dict)

    def reject(self, block: str, reason: str) -> None:
        self.reasons.setdefault(block, reason)

    def match(self, core: Core) -> None:
        self.matched[core.block] = core
        self.reasons.pop(core.block, None)


@dataclass(frozen=True)
class Core:
    """One recognised attention core, ready to become an Sdpa node."""

    block: str
    query: ir.Value  # [B, H, S, Dk] (rank 3: [N, S, Dk])
    key: ir.Value  # K in ``key_form``: [B, G, T, Dk], [B, T, G, Dk] or K^T
    key_form: str  # "bhtd" | "bthd" | "kt"
    value: ir.Value  # [B, G, T, Dv]
    rank: int
    heads: int
    kv_heads: int
    scale: float
    mask: MaskMeaning
    nan_to_zero: bool
    self_attention: bool
    softcap: float = 0.0
    split_heads: bool = False  # rank-3 [B*H, S, D] operands around a [B, H, S, T] softmax
    # GPT-J in float16: Q.K^T and softmax in float32, V (and A.V) in float16. The kernel runs
    # in float32 on V cast up, its output cast back: the original's float16 probabilities are
    # only rounded less.
    out_dtype: ir.DataType | None = None
    sink: np.ndarray | None = None  # [H] logits in each row's denominator (rewrite/recognise/attention_sinks.py)
    head_scale: np.ndarray | None = None  # [H] factors of Q·K^T, folded into Q (Swin-v2)

    def describe(self) -> str:
        """e.g. ``causal + key padding, window 4096, 8 q heads / 2 kv heads, softcap 50``."""
        text = self.mask.describe()
        if self.kv_heads != self.heads:
            text += f", {self.heads} q heads / {self.kv_heads} kv heads"
        if self.softcap:
            text += f", softcap {self.softcap:g}"
        if self.out_dtype is not None:
            text += f", scores in {self.query.dtype}, values in {self.out_dtype}"
        if self.sink is not None:
            text += ", attention sinks"
        if self.head_scale is not None:
            text += ", a scale per head"
        return text


@dataclass(frozen=True)
class _Operands:
    query: ir.Value
    key: ir.Value
    key_form: str
    value: ir.Value
    heads: int
    kv_heads: int
    scale: float
    dims: ScoreDims


def _score_rank(tail, opset: int, block: str) -> int:
    score_dims, seen = dims(tail.scores), dims(tail.softmax.inputs[0])
    if score_dims is None or seen is None or len(score_dims) not in (3, 4):
        raise Reject(block, "the scores' rank is unknown or not 3/4 (shape inference failed)")
    rank = len(score_dims)
    axis = int_attr(tail.softmax, "axis", -1 if opset >= 13 else 1)
    if axis not in (-1, len(seen) - 1):
        raise Reject(block, f"Softmax over axis {axis}, not over the keys (last axis)")
    return rank


def _grouping(key: ir.Value, key_form: str, value: ir.Value, heads: object
              ) -> tuple[ir.Value, ir.Value, int] | None:
    """K and V repeated from (or broadcast over) the same G < H heads: their [B, G, T, D]
    sources and G. One K/V head that the MatMul broadcasts (multi-query, Falcon) may also come
    as K^T [B, 1, D, T]: the head axis is the same in every key form but [B, T, G, D]."""
    if key_form == "bthd" or not isinstance(heads, int):
        return None
    for find in (repeated_heads, broadcast_heads) if key_form == "bhtd" else (broadcast_heads,):
        k, v = find(key, heads), find(value, heads)
        if k is not None and v is not None and k.kv_heads == v.kv_heads:
            return k.source, v.source, k.kv_heads
    return None


def _operands(qk: ir.Node, value: ir.Value, rank: int, block: str) -> _Operands:
    """Q, K, V and their heads from Q·K^T and the V operand."""
    query, q_scale = strip_scale(qk.inputs[0])
    kt, k_scale = strip_scale(qk.inputs[1])
    key, key_form = key_from_transposed(kt, rank)
    qd, vd = dims(query), dims(value)
    kd = key_dims(key, key_form, kt, rank)
    if qd is None or vd is None or kd is None or len(qd) != rank or len(vd) != rank:
        raise Reject(block, "Q, K or V has an unknown shape or a rank other than the scores'")
    batch, seq_q, dk = qd[0], qd[-2], qd[-1]
    heads = qd[1] if rank == 4 else 1
    if not (same_dim(kd[0], batch) and same_dim(vd[0], batch)):
        lost = [str(d) for d in (batch, kd[0], vd[0]) if str(d).startswith("unk__")]
        raise Reject(block, "Q, K and V do not share their leading (batch) dim" + (
            f" (shape inference lost it on the way: {', '.join(lost)})" if lost else ""))
    kv_heads = heads
    if rank == 4:
        grouped = _grouping(key, key_form, value, heads)
        if grouped is not None:
            key, value, kv_heads = grouped
        elif not (same_dim(kd[1], heads) and same_dim(vd[1], heads)):
            raise Reject(block, "Q, K and V do not share head dims and K/V are not grouped "
                         "(repeated or broadcast) heads")
    seq_kv, dv = vd[-2], vd[-1]
    if not same_dim(kd[-1], dk) or not same_dim(kd[-2], seq_kv):
        raise Reject(block, "K's shape does not match Q and V")
    for name, dim in (("heads", heads), ("d_k", dk), ("d_v", dv)):
        if not isinstance(dim, int):
            raise Reject(block, f"the number of {name} is not static ({dim})")
    sd = ScoreDims(batch, heads, seq_q, seq_kv, rank)
    return _Operands(query, key, key_form, value, int(heads), int(kv_heads),  # type: ignore[arg-type]
                     q_scale * k_scale, sd)


def _split_operands(tail, chain, value: ir.Value, rank: int, block: str) -> _Operands:
    """Heads merged into the batch for Q·K^T and A·V ([B*H, S, D], baddbmm style) while the
    Softmax sees [B, H, S, T]: the rank-3 operands, with H and the 4-D score dims."""
    if tail.merged != chain.split or rank != 4:
        raise Reject(tail.block, "heads are merged and split around the Softmax inconsistently")
    ops = _operands(chain.matmul, value, 3, tail.block)
    score = dims(tail.scores) or [None] * 4
    sd = ScoreDims(score[0], tail.merged, score[2], score[3], 4)
    return _Operands(ops.query, ops.key, ops.key_form, ops.value, tail.merged, tail.merged,
                     ops.scale, sd)


def parse_softmax_attention(matmul: ir.Node, opset: int, oracle: Oracle) -> Core:
    """Recognise ``MatMul(probs, V)`` as an attention core or raise Reject(reason)."""
    tail = probs_tail(matmul)
    block = tail.block
    rank = _score_rank(tail, opset, block)
    chain = score_chain(tail.softmax, block, tail.scores)
    split = bool(tail.merged or chain.split)
    if split:
        ops = _split_operands(tail, chain, matmul.inputs[1], rank, block)
        rank = 3
    else:
        ops = _operands(chain.matmul, matmul.inputs[1], rank, block)
    if ops.query.dtype not in SUPPORTED_DTYPES:
        raise Reject(block, f"dtype {ops.query.dtype} has no fused attention kernel here")
    out_dtype = None
    if ops.value.dtype != ops.query.dtype:  # e.g. GPT-J: Q.K^T in float32, V in float16
        if (ops.query.dtype, ops.value.dtype) != (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            raise Reject(block, f"mixed precision: scores in {ops.query.dtype}, values in "
                                f"{ops.value.dtype}; no fused kernel takes both")
        out_dtype = ops.value.dtype
    try:
        mask = plan(list(chain.terms), ops.dims, oracle)
    except Unsupported as exc:
        raise Reject(block, str(exc)) from None
    if chain.floor is not None and mask.terms \
            and (mask.fill < chain.floor or mask.fill > ABSORBING):
        raise Reject(block, f"masked scores ({mask.fill:g}) clamped at {chain.floor:g}: exact "
                     "only where the fill absorbs the scores (float32)")
    sink = _sink(tail.sliced, chain.sink, ops.heads, rank, block)
    if chain.head_scale is not None and (split or rank != 4
                                         or chain.head_scale.size != ops.heads):
        raise Reject(block, f"a scale per head of {chain.head_scale.size} factors on "
                            f"{ops.heads} heads{' merged into the batch' if split else ''}")
    return Core(
        block=block, query=ops.query, key=ops.key, key_form=ops.key_form, value=ops.value,
        rank=rank, heads=ops.heads, kv_heads=ops.kv_heads, scale=chain.scale * ops.scale,
        mask=mask, nan_to_zero=tail.nan_to_zero,
        self_attention=same_dim(ops.dims.seq_q, ops.dims.seq_kv),
        softcap=chain.softcap, split_heads=split, out_dtype=out_dtype, sink=sink,
        head_scale=chain.head_scale,
    )


def _sink(sliced: bool, column: ir.Value | None, heads: int, rank: int, block: str
          ) -> np.ndarray | None:
    """The [H] sink logits where a column joins the scores and leaves the probabilities."""
    if not sliced and column is None:
        return None
    if sliced != (column is not None):
        raise Reject(block, "a column concatenated to the scores is not the one sliced off "
                     "the probabilities (not an attention sink)" if column is not None else
                     "the probabilities are sliced before A·V")
    values = sink_values(column, heads) if rank == 4 else None
    if values is None:
        raise Reject(block, "attention sinks other than one constant logit per head (computed "
                     "at run time, or over merged heads)")
    return values


def check_sink(core: Core, policy) -> None:
    """Sinks have ORT's kernels only (policy.fuses_sinks; lower/common.dense_mha)."""
    if core.sink is not None and not policy.fuses_sinks():
        raise Reject(core.block, "attention sinks are fused for --target ort only "
                     "(GroupQueryAttention's head_sink; the ONNX Attention op has none)")


def parse_onnx_attention(node: ir.Node, block: str, oracle: Oracle) -> Core:
    """The ONNX ``Attention`` op (4-D inputs) as a core; grouped K/V and is_causal kept."""
    inputs = list(node.inputs) + [None] * (7 - len(node.inputs))
    query, key, value, mask = inputs[:4]
    if any(v is not None for v in inputs[4:7]) or any(
            o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        raise Reject(block, "Attention with past key/value or extra outputs is left as is")
    if int_attr(node, "qk_matmul_output_mode", 0):
        raise Reject(block, "Attention with a qk output mode is left as is")
    qd, kd, vd = dims(query), dims(key), dims(value)
    if any(d is None or len(d) != 4 for d in (qd, kd, vd)):
        raise Reject(block, "only 4-D [B, H, S, D] Attention inputs are rewritten")
    batch, heads, seq_q, dk = qd  # type: ignore[misc]
    kv_heads, seq_kv, dv = kd[1], vd[2], vd[3]  # type: ignore[index]
    grouped = _grouping(key, "bhtd", value, heads)
    if grouped is not None:  # K/V repeated up to H heads before the op: keep them grouped
        key, value, kv_heads = grouped
        kd, vd = dims(key), dims(value)
    if not all(isinstance(d, int) for d in (heads, kv_heads, dk, dv)) or heads % kv_heads:
        raise Reject(block, "head counts or head sizes are not static, or not grouped evenly")
    if not same_dim(vd[1], kv_heads) or query.dtype not in SUPPORTED_DTYPES:  # type: ignore[index]
        raise Reject(block, f"K/V heads differ or dtype {query.dtype} has no fused kernel")
    sd = ScoreDims(batch, heads, seq_q, seq_kv, 4)
    causal = int_attr(node, "is_causal", 0) == 1
    if causal and mask is not None:
        raise Reject(block, "Attention with both is_causal and a mask is left as is")
    if causal:
        align = "square" if same_dim(seq_q, seq_kv) else "top-left"
        meaning = MaskMeaning(causal=Causal(0, align))
    elif mask is None:
        meaning = MaskMeaning()
    else:  # bool: True = take part; float: added
        term = (Term("replace", mask, 1.0, -math.inf, False) if mask.dtype == ir.DataType.BOOL
                else Term("add", mask, 1.0))
        try:
            meaning = plan([term], sd, oracle)
        except Unsupported as exc:
            raise Reject(block, str(exc)) from None
    return Core(
        block=block, query=query, key=key, key_form="bhtd", value=value, rank=4,
        heads=int(heads), kv_heads=int(kv_heads), scale=float_attr(node, "scale", 1 / math.sqrt(dk)),
        mask=meaning, nan_to_zero=mask is not None,  # ORT runs fully masked rows to zeros
        self_attention=same_dim(seq_q, seq_kv),
        softcap=float_attr(node, "softcap", 0.0),
    )


def check_softcap(core: Core, policy) -> None:
    """Soft-capped scores have one fused kernel: GroupQueryAttention (``--target ort``,
    policy.softcap_on_gqa), for
    causal self-attention whose head sizes it takes and no position bias, square or aligned
    to the end of the keys (a KV cache: GQA with past for a step). The runs GQA does not take
    (left-padded rows, a chunk after a past) write the capped scores out (lower/common.py)."""
    if not core.softcap:
        return
    causal = core.mask.causal
    fits = (policy.softcap_on_gqa() and causal is not None
            and causal.alignment in ("square", "bottom-right") and not core.mask.added
            and not core.mask.reason and core.query is not None and _head_sizes_fit(core))
    if not fits:
        raise Reject(core.block, "soft-capped scores are fused only onto GroupQueryAttention "
                     "(--target ort): causal self-attention, d_k = d_v a multiple of 8, no bias")


def _head_sizes_fit(core: Core) -> bool:
    dk, dv = (dims(core.query) or [0])[-1], (dims(core.value) or [0])[-1]
    return dk == dv and isinstance(dk, int) and dk % 8 == 0


def _not_understood(exc: Exception) -> str:
    return (f"mha-onnx failed reading this block ({type(exc).__name__}: {str(exc)[:160]}); "
            "it is left as it is (please report)")


def _softmax_of(probs: ir.Value) -> ir.Node | None:
    """The Softmax whose probabilities reach ``probs`` through value-keeping ops."""
    current = probs
    for _ in range(6):
        node = current.producer() if current is not None else None
        if node is None:
            return None
        if node.op_type == "Softmax":
            return node
        current = node.inputs[0] if node.inputs else None
    return None


class SoftmaxAttention(pattern.RewriteRuleClassBase):
    """MatMul(Softmax(...), V) -> Sdpa; see parse_softmax_attention for what is accepted."""

    def __init__(self, log: BlockLog, opset: int, oracle: Oracle, policy) -> None:
        super().__init__("SoftmaxAttention", remove_nodes=False)
        self.log, self.opset, self.oracle, self.policy = log, opset, oracle, policy
        self._core: Core | None = None

    def pattern(self, op, probs, value):
        return op.MatMul(probs, value, _outputs=["attn"])

    def check(self, context, probs, value, attn, **_):
        result = MatchResult()
        softmax = _softmax_of(probs)
        if softmax is not None and FORM in softmax.metadata_props:
            return result.fail("a form mha-onnx wrote (fused already)")
        try:
            self._core = parse_softmax_attention(attn.producer(), self.opset, self.oracle)
            check_softcap(self._core, self.policy)
            check_sink(self._core, self.policy)
        except Reject as exc:
            if exc.candidate:
                self.log.reject(exc.block, exc.reason)
            return result.fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here leaves the block, not the run
            if softmax is not None:
                self.log.reject(softmax.name or "Softmax", _not_understood(exc))
            return result.fail(_not_understood(exc))
        return result

    def rewrite(self, op, probs, value, attn, **_):
        assert self._core is not None
        self.log.match(self._core)
        return emit_sdpa(op, self._core)


class OnnxAttention(pattern.RewriteRuleClassBase):
    """The ONNX ``Attention`` op (opset 23+, e.g. from torch's SDPA export) -> Sdpa, so the
    same lowering picks ORT's fastest kernel and repairs mask shapes ORT refuses."""

    def __init__(self, log: BlockLog, oracle: Oracle, policy) -> None:
        super().__init__("OnnxAttention", remove_nodes=True)
        self.log, self.oracle, self.policy = log, oracle, policy
        self._core: Core | None = None

    def pattern(self, op, query, key, value):
        return op.Attention(query, key, value, _allow_other_inputs=True,
                            _allow_other_attributes=True, _outputs=["attn"])

    def check(self, context, query, key, value, attn, **_):
        result = MatchResult()
        node = attn.producer()
        block = node.name or "Attention"
        try:
            self._core = parse_onnx_attention(node, block, self.oracle)
            check_softcap(self._core, self.policy)
            check_sink(self._core, self.policy)
        except Reject as exc:
            self.log.reject(block, exc.reason)
            return result.fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here leaves the block, not the run
            self.log.reject(block, _not_understood(exc))
            return result.fail(_not_understood(exc))
        return result

    def rewrite(self, op, query, key, value, attn, **_):
        assert self._core is not None
        self.log.match(self._core)
        return emit_sdpa(op, self._core)
