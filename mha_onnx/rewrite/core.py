"""Stage 1: recognise attention cores and replace them by one internal op.

``MatMul(Softmax(mask(scale(Q·K^T))), V)`` in its many spellings (scale as Div, Mul, split
over Q and K, or absent; K transposed in three ways; masks as Add or Where; a NaN guard or a
Cast after the Softmax) and the ONNX ``Attention`` op become
``mha_onnx.fusion.Sdpa(Q[B,H,S,Dk], K[B,H,T,Dk], V[B,H,T,Dv], mask?)`` with attributes that
say everything the lowering needs (scale, heads, mask kind and fill, NaN guard). The check of
each rule says why a candidate was left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from mha_onnx.rewrite.irutil import (
    const_fill,
    const_scalar,
    dims,
    float_attr,
    int_attr,
    ints_attr,
    producer,
    same_dim,
)
from mha_onnx.rewrite.masks import (
    REMOVES_KEY,
    MaskPlan,
    ScoreDims,
    Term,
    bias_meaning,
    bool_meaning,
    plan,
)

FUSION_DOMAIN = "mha_onnx.fusion"
SUPPORTED_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
PROBS_OPS = ("Cast", "Dropout", "Identity")
MAX_SCORE_OPS = 32


class Reject(Exception):
    """A candidate block that cannot be fused, and why."""


@dataclass
class BlockLog:
    """What happened to each attention block (keyed by its Softmax node)."""

    reasons: dict[str, str] = field(default_factory=dict)
    matched: dict[str, dict[str, object]] = field(default_factory=dict)

    def reject(self, block: str, reason: str) -> None:
        self.reasons.setdefault(block, reason)

    def match(self, block: str, info: dict[str, object]) -> None:
        self.matched[block] = info
        self.reasons.pop(block, None)


@dataclass
class Core:
    """One recognised attention core, ready to become an Sdpa node."""

    block: str
    query: ir.Value
    key: ir.Value
    key_form: str  # "bhtd" | "bthd" (needs a transpose) | "kt" (K^T given)
    value: ir.Value
    rank: int
    heads: int
    dk: int
    dv: int
    scale: float
    mask: MaskPlan
    nan_to_zero: bool
    self_attention: bool
    dims: ScoreDims


def _scalar_factor(node: ir.Node) -> tuple[ir.Value, float] | None:
    """For Mul/Div by a constant scalar: (the other operand, the factor)."""
    a, b = node.inputs[0], node.inputs[1]
    if node.op_type == "Mul":
        for x, c in ((a, b), (b, a)):
            value = const_scalar(c)
            if value is not None and math.isfinite(value) and value != 0:
                return x, value
    if node.op_type == "Div":
        value = const_scalar(b)
        if value is not None and math.isfinite(value) and value != 0:
            return a, 1.0 / value
    return None


def _reaches_matmul(value: ir.Value) -> bool:
    """Does ``value`` come from a MatMul through the ops allowed between Q·K^T and Softmax?"""
    current = value
    for _ in range(MAX_SCORE_OPS):
        node = producer(current)
        if node is None:
            return False
        if node.op_type == "MatMul":
            return True
        if node.op_type in ("Mul", "Div"):
            found = _scalar_factor(node)
            if found is None:
                return False
            current = found[0]
        elif node.op_type == "Add":
            return any(_reaches_matmul(v) for v in node.inputs)
        elif node.op_type == "Where":
            return _reaches_matmul(node.inputs[1]) or _reaches_matmul(node.inputs[2])
        elif node.op_type == "Cast":
            current = node.inputs[0]
        else:
            return False
    return False


def _strip_scale(value: ir.Value) -> tuple[ir.Value, float]:
    factor = 1.0
    for _ in range(4):
        node = producer(value, "Mul", "Div")
        found = _scalar_factor(node) if node is not None else None
        if found is None:
            break
        value, f = found
        factor *= f
    return value, factor


def _key_from_transposed(kt: ir.Value, rank: int) -> tuple[ir.Value, str]:
    """K in [B, H, T, Dk] (or the BTHD source) from the K^T operand of Q·K^T."""
    node = producer(kt, "Transpose")
    if node is not None:
        perm = ints_attr(node, "perm")
        if rank == 4 and perm == [0, 1, 3, 2]:
            return node.inputs[0], "bhtd"
        if rank == 4 and perm == [0, 2, 3, 1]:
            return node.inputs[0], "bthd"
        if rank == 3 and perm == [0, 2, 1]:
            return node.inputs[0], "bhtd"
    node = producer(kt, "Reshape")
    if node is not None and rank == 4:
        inner = producer(node.inputs[0], "Transpose")
        if inner is not None and ints_attr(inner, "perm") == [0, 2, 1]:
            flat = producer(inner.inputs[0], "Reshape")
            if flat is not None:
                k4 = flat.inputs[0]
                kd, ktd = dims(k4), dims(kt)
                if (
                    kd is not None and ktd is not None and len(kd) == 4
                    and same_dim(kd[0], ktd[0]) and same_dim(kd[1], ktd[1])
                    and same_dim(kd[2], ktd[3]) and same_dim(kd[3], ktd[2])
                ):
                    return k4, "bhtd"
    return kt, "kt"


def _key_dims(key: ir.Value, form: str, kt: ir.Value, rank: int) -> list | None:
    """K's dims in [B, H, T, Dk] order (rank 3: [N, T, Dk]), whichever form K was found in."""
    if form == "bhtd":
        kd = dims(key)
    elif form == "bthd":
        src = dims(key)
        kd = None if src is None or len(src) != 4 else [src[0], src[2], src[1], src[3]]
    else:
        src = dims(kt)
        kd = None if src is None else src[:-2] + [src[-1], src[-2]]
    if kd is None or len(kd) != rank:
        return None
    return kd


def parse_softmax_attention(matmul: ir.Node, opset: int) -> Core:
    """Recognise ``MatMul(probs, V)`` as an attention core or raise Reject(reason)."""
    probs, value = matmul.inputs[0], matmul.inputs[1]
    chain: list[ir.Node] = [matmul]
    nan_to_zero = False
    current = probs
    softmax = None
    for _ in range(6):
        node = producer(current)
        if node is None:
            break
        if node.op_type == "Softmax":
            softmax = node
            break
        if node.op_type == "Where" and const_scalar(node.inputs[1]) == 0.0:
            isnan = producer(node.inputs[0], "IsNaN")
            if isnan is not None and isnan.inputs[0] is node.inputs[2]:
                nan_to_zero = True
                chain += [node, isnan]
                current = node.inputs[2]
                continue
        if node.op_type in PROBS_OPS:
            chain.append(node)
            current = node.inputs[0]
            continue
        break
    if softmax is None:
        raise Reject("not attention: the MatMul's left input is not a Softmax")
    block = softmax.name or "softmax"
    chain.append(softmax)
    chain_set = set(chain)
    for node in chain[1:]:
        for out in node.outputs:
            if out.is_graph_output() or any(u not in chain_set for u, _ in out.uses()):
                raise Reject(
                    f"{block}: the attention weights are also used elsewhere (an output or "
                    "another node); fusing would not remove them"
                )

    scores_in = softmax.inputs[0]
    score_dims = dims(scores_in)
    if score_dims is None or len(score_dims) not in (3, 4):
        raise Reject(f"{block}: the scores' rank is unknown or not 3/4 (shape inference failed)")
    srank = len(score_dims)
    axis = int_attr(softmax, "axis", -1 if opset >= 13 else 1)
    if axis not in (-1, srank - 1):
        raise Reject(f"{block}: Softmax over axis {axis}, not over the keys (last axis)")

    post = 1.0
    terms: list[Term] = []
    current = scores_in
    mm = None
    for _ in range(MAX_SCORE_OPS):
        node = producer(current)
        if node is None:
            raise Reject(f"{block}: the Softmax input does not come from Q·K^T")
        op = node.op_type
        if op == "MatMul":
            mm = node
            break
        if op in ("Mul", "Div"):
            found = _scalar_factor(node)
            if found is None:
                raise Reject(f"{block}: scores are scaled by a non-constant or zero ({op})")
            current, factor = found
            post *= factor
        elif op == "Add":
            a, b = node.inputs
            ra, rb = _reaches_matmul(a), _reaches_matmul(b)
            if ra == rb:
                raise Reject(f"{block}: cannot tell scores from mask in an Add")
            current, bias = (a, b) if ra else (b, a)
            terms.append(Term("add", bias, post))
        elif op == "Where":
            cond, a, b = node.inputs
            ca, cb = const_fill(a), const_fill(b)
            if ca is not None and cb is None and _reaches_matmul(b):
                terms.append(Term("replace", cond, post, fill=ca, masked_when=True))
                current = b
            elif cb is not None and ca is None and _reaches_matmul(a):
                terms.append(Term("replace", cond, post, fill=cb, masked_when=False))
                current = a
            else:
                raise Reject(f"{block}: a Where between Q·K^T and Softmax is not a masked fill")
        elif op == "Cast":
            current = node.inputs[0]
        elif op == "Tanh":
            raise Reject(f"{block}: soft-capped scores (Tanh) have no fused kernel here")
        else:
            raise Reject(f"{block}: {op} between Q·K^T and Softmax is not an attention pattern")
    if mm is None:
        raise Reject(f"{block}: the Softmax input does not come from Q·K^T")

    query, q_scale = _strip_scale(mm.inputs[0])
    kt, k_scale = _strip_scale(mm.inputs[1])
    key, key_form = _key_from_transposed(kt, srank)
    scale = post * q_scale * k_scale

    qd, vd = dims(query), dims(value)
    if qd is None or vd is None or len(qd) != srank or len(vd) != srank:
        raise Reject(f"{block}: Q or V has an unknown shape or a rank other than the scores'")
    kd = _key_dims(key, key_form, kt, srank)
    if kd is None:
        raise Reject(f"{block}: K has an unknown shape")
    if srank == 4:
        batch, heads, seq_q, dk = qd
        if not (same_dim(kd[0], batch) and same_dim(kd[1], heads)
                and same_dim(vd[0], batch) and same_dim(vd[1], heads)):
            raise Reject(
                f"{block}: Q, K and V do not share batch and head dims (broadcast K/V or "
                "grouped heads are not fused)"
            )
    else:
        batch, seq_q, dk = qd
        heads = 1
        if not (same_dim(kd[0], batch) and same_dim(vd[0], batch)):
            raise Reject(f"{block}: Q, K and V do not share their leading dim")
    seq_kv, dv = vd[-2], vd[-1]
    if not same_dim(kd[-1], dk) or not same_dim(kd[-2], seq_kv):
        raise Reject(f"{block}: K's shape does not match Q and V")
    for name, dim in (("heads", heads), ("d_k", dk), ("d_v", dv)):
        if not isinstance(dim, int):
            raise Reject(f"{block}: the number of {name} is not static ({dim})")
    if query.dtype not in SUPPORTED_DTYPES or value.dtype != query.dtype:
        raise Reject(f"{block}: dtype {query.dtype} has no fused attention kernel here")

    sd = ScoreDims(batch, heads if srank == 4 else 1, seq_q, seq_kv, srank)
    mask = plan(terms, sd, nan_to_zero)
    if mask.kind == "unsupported":
        raise Reject(f"{block}: {mask.reason}")
    return Core(
        block=block, query=query, key=key, key_form=key_form, value=value, rank=srank,
        heads=int(heads), dk=int(dk), dv=int(dv), scale=scale, mask=mask,
        nan_to_zero=nan_to_zero, self_attention=same_dim(seq_q, seq_kv), dims=sd,
    )


def emit_sdpa(op, core: Core) -> ir.Value:
    """Build the Sdpa node for ``core``; returns the [B,H,S,Dv] (rank-3: [N,S,Dv]) output."""
    query, key, value = core.query, core.key, core.value
    if core.key_form == "bthd":
        key = op.Transpose(key, perm=[0, 2, 1, 3])
    elif core.key_form == "kt":
        key = op.Transpose(key, perm=[0, 1, 3, 2] if core.rank == 4 else [0, 2, 1])
    if core.rank == 3:  # one head per (batch x head) row: [N, 1, S, D]
        axis = op.Constant(value_ints=[1])
        query, key, value = (op.Unsqueeze(x, axis) for x in (query, key, value))
    inputs = [query, key, value]
    mask = core.mask
    attrs = {
        "scale": float(core.scale),
        "num_heads": core.heads,
        "mask_kind": mask.kind,
        "fill": float(mask.fill),
        "fill_mode": mask.mode,
        "nan_to_zero": int(core.nan_to_zero),
        "self_attention": int(core.self_attention),
        "block": core.block,
    }
    if mask.kind == "key_padding":
        inputs.append(_padded_keys(op, mask))
    elif mask.kind == "bias":
        inputs.append(_dense_bias(op, core))
    out = op.Sdpa(*inputs, _domain=FUSION_DOMAIN, **attrs)
    if core.rank == 3:
        out = op.Squeeze(out, op.Constant(value_ints=[1]))
    return out


def _padded_keys(op, mask: MaskPlan) -> ir.Value:
    """bool [B, T], True where the key is padded."""
    meaning = mask.padding
    assert meaning is not None and meaning.source is not None
    source = meaning.source
    if source.dtype == ir.DataType.BOOL:
        return op.Not(source) if meaning.inverted else source
    is_zero = op.Equal(source, op.CastLike(op.Constant(value_float=0.0), source))
    return is_zero if meaning.inverted else op.Not(is_zero)


def _dense_bias(op, core: Core) -> ir.Value:
    """The sum of all mask terms as one additive bias, rank 4, in the query's dtype."""
    dtype = core.query.dtype
    np_dtype = np.float16 if dtype == ir.DataType.FLOAT16 else np.float32
    total = None
    for term in core.mask.terms:
        if term.mode == "add":
            piece = term.value
            if piece.dtype != dtype:
                piece = op.Cast(piece, to=dtype)
            if term.post != 1.0:
                piece = op.Mul(piece, op.Constant(value=ir.tensor(np.array(term.post, np_dtype))))
        else:
            fill = np.array(term.fill * term.post, np_dtype)
            zero = np.array(0.0, np_dtype)
            on, off = (fill, zero) if term.masked_when else (zero, fill)
            cond = term.value
            if cond.dtype != ir.DataType.BOOL:
                cond = op.Cast(cond, to=ir.DataType.BOOL)
            piece = op.Where(cond, op.Constant(value=ir.tensor(on)), op.Constant(value=ir.tensor(off)))
        total = piece if total is None else op.Add(total, piece)
    assert total is not None
    shape = dims(total) or dims(core.mask.terms[0].value)
    r = len(shape) if shape is not None else core.rank
    if core.rank == 3:
        if r < 3:
            total = op.Unsqueeze(total, op.Constant(value_ints=list(range(3 - r))))
        return op.Unsqueeze(total, op.Constant(value_ints=[1]))
    if r < 4:
        total = op.Unsqueeze(total, op.Constant(value_ints=list(range(4 - r))))
    return total


class SoftmaxAttention(pattern.RewriteRuleClassBase):
    """MatMul(Softmax(...), V) -> Sdpa; see parse_softmax_attention for what is accepted."""

    def __init__(self, log: BlockLog, opset: int) -> None:
        super().__init__("SoftmaxAttention", remove_nodes=False)
        self.log = log
        self.opset = opset
        self._core: Core | None = None

    def pattern(self, op, probs, value):
        return op.MatMul(probs, value, _outputs=["attn"])

    def check(self, context, probs, value, attn, **_):
        result = MatchResult()
        try:
            self._core = parse_softmax_attention(attn.producer(), self.opset)
        except Reject as exc:
            message = str(exc)
            if not message.startswith("not attention"):
                self.log.reject(message.split(":")[0], message.split(": ", 1)[-1])
            return result.fail(message)
        return result

    def rewrite(self, op, probs, value, attn, **_):
        core = self._core
        assert core is not None
        self.log.match(core.block, {"mask": core.mask.kind, "heads": core.heads})
        return emit_sdpa(op, core)


class OnnxAttention(pattern.RewriteRuleClassBase):
    """The ONNX ``Attention`` op (opset 23+, e.g. from torch's SDPA export) -> Sdpa, so the
    same lowering picks ORT's fastest kernel and repairs mask shapes ORT refuses."""

    def __init__(self, log: BlockLog) -> None:
        super().__init__("OnnxAttention", remove_nodes=True)
        self.log = log
        self._core: Core | None = None

    def pattern(self, op, query, key, value):
        return op.Attention(query, key, value, _allow_other_inputs=True,
                            _allow_other_attributes=True, _outputs=["attn"])

    def check(self, context, query, key, value, attn, **_):
        result = MatchResult()
        node = attn.producer()
        block = node.name or "Attention"
        try:
            self._core = _parse_onnx_attention(node, block)
        except Reject as exc:
            self.log.reject(block, str(exc))
            return result.fail(str(exc))
        return result

    def rewrite(self, op, query, key, value, attn, **_):
        core = self._core
        assert core is not None
        self.log.match(core.block, {"mask": core.mask.kind, "heads": core.heads})
        return emit_sdpa(op, core)


def _parse_onnx_attention(node: ir.Node, block: str) -> Core:
    inputs = list(node.inputs) + [None] * (7 - len(node.inputs))
    query, key, value, mask = inputs[:4]
    if any(v is not None for v in inputs[4:7]) or len(node.outputs) > 1 and any(
        o.uses() or o.is_graph_output() for o in node.outputs[1:]
    ):
        raise Reject("Attention with past key/value or extra outputs is left as is")
    if float_attr(node, "softcap", 0.0) != 0.0 or int_attr(node, "qk_matmul_output_mode", 0):
        raise Reject("Attention with softcap or qk output mode is left as is")
    qd, kd, vd = dims(query), dims(key), dims(value)
    if qd is None or kd is None or vd is None or len(qd) != 4 or len(kd) != 4 or len(vd) != 4:
        raise Reject("only 4-D [B, H, S, D] Attention inputs are rewritten")
    batch, heads, seq_q, dk = qd
    if not (same_dim(kd[1], heads) and same_dim(vd[1], heads)):
        raise Reject("grouped-query Attention (fewer K/V heads) is left as is")
    seq_kv, dv = vd[2], vd[3]
    if not all(isinstance(d, int) for d in (heads, dk, dv)):
        raise Reject("head count or head size is not static")
    if query.dtype not in SUPPORTED_DTYPES:
        raise Reject(f"dtype {query.dtype} has no fused attention kernel here")
    scale = float_attr(node, "scale", 1.0 / math.sqrt(dk))
    causal = int_attr(node, "is_causal", 0) == 1
    sd = ScoreDims(batch, heads, seq_q, seq_kv, 4)
    if causal and mask is not None:
        raise Reject("Attention with both is_causal and a mask is left as is")
    if causal:
        plan_ = MaskPlan("causal", fill=-math.inf)
    elif mask is None:
        plan_ = MaskPlan("none")
    elif mask.dtype == ir.DataType.BOOL:  # True = take part in attention
        meaning = bool_meaning(mask, sd)
        if meaning.kind == "key_padding":
            meaning = type(meaning)(meaning.kind, meaning.source, not meaning.inverted)
            plan_ = MaskPlan("key_padding", fill=-math.inf, mode="add", padding=meaning)
        else:
            plan_ = MaskPlan("bias", terms=(Term("replace", mask, 1.0, -math.inf, False),))
    else:
        term = Term("add", mask, 1.0)
        found = bias_meaning(term, sd)
        if found and found[0].kind == "key_padding" and found[1] <= REMOVES_KEY:
            plan_ = MaskPlan("key_padding", fill=found[1], mode="add", padding=found[0])
        else:
            plan_ = MaskPlan("bias", terms=(term,))
    # ORT runs Attention's fully masked rows to zeros; keep that behaviour.
    return Core(
        block=block, query=query, key=key, key_form="bhtd", value=value, rank=4,
        heads=int(heads), dk=int(dk), dv=int(dv), scale=scale, mask=plan_,
        nan_to_zero=mask is not None, self_attention=same_dim(seq_q, seq_kv), dims=sd,
    )
