"""Finding attention blocks in any ONNX graph: fused attention ops and unfused
MatMul -> Softmax -> MatMul chains (subgraphs of Loop/If/Scan included)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import onnx_ir as ir

from mha_onnx.rewrite.irutil import FORM, MS_DOMAIN, WALK_LIMIT, subgraphs

# (domain, op_type) of ops that are attention kernels in their own right.
FUSED_OPS = {
    (MS_DOMAIN, "MultiHeadAttention"),
    (MS_DOMAIN, "Attention"),
    (MS_DOMAIN, "GroupQueryAttention"),
    (MS_DOMAIN, "PackedMultiHeadAttention"),
    (MS_DOMAIN, "PackedAttention"),
    (MS_DOMAIN, "DecoderMaskedMultiHeadAttention"),
    (MS_DOMAIN, "SparseAttention"),
    ("", "Attention"),
}
# Ops that keep the probabilities' values between the Softmax and the MatMul with V.
PROBS_OPS = ("Cast", "Dropout", "Identity")
# Ops allowed there: those, a NaN guard (Where of IsNaN) and the heads merged (Reshape), each
# of which the recogniser reads as what it is (scores.py: the one definition of the tail).
PROBS_PASSTHROUGH = {*PROBS_OPS, "Where", "IsNaN", "Reshape"}
# ... and, when looking for blocks, the Slice that drops a sink's column (GPT-OSS)
_PROBS_WALK = PROBS_PASSTHROUGH | {"Slice"}
# Ops that multiply two tensors: a product of two activations feeding a Softmax is attention.
PRODUCTS = {"MatMul", "Einsum", "Gemm"}
# Ops walked through from the Softmax back to Q·K^T when looking for blocks (wider than what
# the fusion accepts, so that a block it cannot fuse is still reported with a reason).
SCORES_WALK_OPS = {"Add", "Sub", "Mul", "Div", "Where", "Cast", "Tanh", "Relu", "Sigmoid",
                   "Clip", "Neg", "Abs", "Identity", "Min", "Max", "Pow", "Sqrt", "Exp",
                   "Reshape", "Unsqueeze", "Squeeze", "Expand", "Transpose", "Erf", "Softplus"}


@dataclass(frozen=True)
class Block:
    """One attention block: ``fused`` (an attention op) or ``unfused`` (a Softmax chain)."""

    kind: str
    op: str
    node: str
    graph: str
    softmax: ir.Node | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "op": self.op, "node": self.node, "graph": self.graph}


def op_label(node: ir.Node) -> str:
    if FORM in node.metadata_props:
        return node.metadata_props[FORM]
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def is_fused_attention(node: ir.Node) -> bool:
    """An attention kernel, or the Softmax of a form mha-onnx wrote out (irutil.FORM)."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    return (domain, node.op_type) in FUSED_OPS or FORM in node.metadata_props


def probs_matmul(softmax: ir.Node) -> ir.Node | None:
    """The MatMul that multiplies this Softmax's probabilities with V, if any."""
    frontier = [softmax.outputs[0]]
    for _ in range(4):
        next_frontier = []
        for value in frontier:
            for user, index in value.uses():
                if user.op_type == "MatMul" and user.domain in ("", "ai.onnx") and index == 0:
                    return user
                if user.op_type in _PROBS_WALK:
                    next_frontier.extend(user.outputs[:1])
        frontier = next_frontier
    return None


def _is_activation(value: ir.Value | None) -> bool:
    """Computed at run time (not an initializer or a constant)."""
    if value is None or value.const_value is not None or value.is_initializer():
        return False
    node = value.producer()
    return node is None or node.op_type not in ("Constant", "ConstantOfShape")


def scores_matmul(softmax: ir.Node) -> ir.Node | None:
    """The product of two activations (Q K^T) upstream of the Softmax input, through
    elementwise and layout ops; the nearest first (breadth first: Swin-v2's window mask,
    added twice, took the whole walk depth first)."""
    seen: set[int] = set()
    stack = deque([softmax.inputs[0]])
    steps = 0
    while stack and steps < WALK_LIMIT:
        value = stack.popleft()
        steps += 1
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        producer = value.producer()
        if producer is None:
            continue
        if producer.op_type in PRODUCTS and producer.domain in ("", "ai.onnx"):
            if sum(_is_activation(v) for v in producer.inputs[:2]) == 2:
                return producer
            continue  # a projection: a weight times an activation
        if producer.op_type in SCORES_WALK_OPS:
            stack.extend(v for v in producer.inputs if v is not None)
        elif producer.op_type == "Concat" and producer.inputs[0] is not None and any(
                value is v for v in (softmax.inputs[0], _shifted_input(softmax))):
            stack.append(producer.inputs[0])  # (an attention sink's column: rewrite/recognise/attention_sinks.py)
    return None


def _shifted_input(softmax: ir.Node) -> ir.Value | None:
    """x of a Softmax over ``x - ReduceMax(x)``."""
    sub = softmax.inputs[0].producer() if softmax.inputs[0] is not None else None
    return sub.inputs[0] if sub is not None and sub.op_type == "Sub" else None


def is_attention_softmax(node: ir.Node) -> bool:
    """Every Softmax over a product of two activations is an attention candidate (whether
    or not its probabilities reach V)."""
    return (node.op_type == "Softmax" and node.domain in ("", "ai.onnx")
            and scores_matmul(node) is not None)


def why_left(softmax: ir.Node) -> str:
    """A reason for a candidate no rule looked at."""
    if probs_matmul(softmax) is None:
        return ("its probabilities never reach a MatMul with V (returned, or used another "
                "way): not a fusable attention core")
    mm = scores_matmul(softmax)
    if mm is not None and mm.op_type != "MatMul":
        return f"Q·K^T is computed by {mm.op_type}, which the fusion does not read"
    if _sink_column(softmax):
        return ("attention sinks (a column concatenated to the scores before the Softmax "
                "and sliced off after it) in a form the fusion does not read (rewrite/recognise/attention_sinks.py "
                "reads GPT-OSS's)")
    return "not recognised as attention by any rule"


def _sink_column(softmax: ir.Node) -> bool:
    """Do the scores reach this Softmax through a Concat on the last axis (after a max
    subtracted or not), and its probabilities reach V through a Slice?"""
    value = softmax.inputs[0]
    for _ in range(3):
        node = value.producer() if value is not None else None
        if node is None:
            return False
        if node.op_type == "Concat" and node.attributes.get_int("axis", 0) == -1:
            break
        if node.op_type not in ("Sub", "Cast"):
            return False
        value = node.inputs[0]
    else:
        return False
    frontier = [softmax.outputs[0]]
    for _ in range(3):
        users = [u for v in frontier for u, _ in v.uses()]
        if any(u.op_type == "Slice" for u in users):
            return True
        frontier = [u.outputs[0] for u in users if u.op_type in PROBS_PASSTHROUGH]
    return False


def find_blocks(graph: ir.Graph) -> list[Block]:
    """Every attention block in ``graph`` and its subgraphs. A control-flow node whose
    subgraphs hold fused attention ops (e.g. mha-onnx's Loop form for key padding, whose
    branches run the kernel on kept keys or on the all-padded rows) is one fused block."""
    blocks = []
    for node in graph:
        inner = [b for sub in subgraphs(node) for b in find_blocks(sub)]
        if any(b.kind == "fused" for b in inner):  # one label, however deep the nesting
            leaves, depth = _fused_leaves(node)
            label = f"{op_label(node)}[{', '.join(sorted(leaves))}]"
            blocks.append(Block("fused", label + (f" ({depth} levels)" if depth > 1 else ""),
                                node.name or "", graph.name or ""))
        blocks.extend(b for b in inner if b.kind == "unfused")
        if is_fused_attention(node):
            blocks.append(Block("fused", op_label(node), node.name or "", graph.name or ""))
        elif is_attention_softmax(node):
            blocks.append(Block("unfused", "MatMul-Softmax-MatMul", node.name or "",
                                graph.name or "", node))
    return blocks


def _fused_leaves(node: ir.Node) -> tuple[set[str], int]:
    """The attention ops inside a control-flow node's subgraphs at any depth, and how many
    control-flow levels hold them (mha-onnx's key-padding forms nest Ifs)."""
    leaves, depth = set(), 1
    for sub in subgraphs(node):
        for inner in sub:
            if is_fused_attention(inner):
                leaves.add(op_label(inner))
            if any(True for _ in subgraphs(inner)):
                found, levels = _fused_leaves(inner)
                leaves |= found
                if found:
                    depth = max(depth, levels + 1)
    return leaves, depth
