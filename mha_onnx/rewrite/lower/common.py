"""What the lowerings share: an ``op``-style builder over an onnx-ir tape (so one form can be
built in the main graph by the rewriter or inside an If/Loop branch), copying a value's
producers into a branch so that it is computed only when that branch runs, unique names for
subgraph values, and the values a fully masked query gets."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import FORM, MS_DOMAIN, dims, subgraphs
from mha_onnx.rewrite.sdpa import SdpaInfo, bsd_source, repeat_heads, seq_dim, to_bsd

# A branch copies at most this many producer nodes of an outer value; beyond, it uses the
# outer value itself (computed whichever branch runs).
MAX_CLONED_NODES = 400


class TapeOps:
    """``ops.MatMul(a, b, _domain=..., _outputs=n, **attributes)`` on an ``ir.tape.Tape``:
    the calling convention of the onnxscript rewriter's ``op`` builder."""

    def __init__(self, tape: ir.tape.Tape | None = None) -> None:
        self.tape = tape if tape is not None else ir.tape.Tape()

    def __getattr__(self, op_type: str) -> Callable[..., Any]:
        if op_type.startswith("_"):
            raise AttributeError(op_type)

        def build(*inputs: ir.Value | None, _domain: str = "", _outputs: int = 1, **attrs: Any):
            attributes = {k: v for k, v in attrs.items() if v is not None}
            if _outputs == 1:
                return self.tape.op(op_type, list(inputs), attributes, domain=_domain)
            return self.tape.op_multi_out(op_type, list(inputs), attributes,
                                          num_outputs=_outputs, domain=_domain)

        return build


def branch(name: str, build: Callable[[TapeOps], Any], dtype: ir.DataType) -> ir.Graph:
    """A subgraph without inputs whose outputs are ``build(ops)`` (one value or a tuple, all
    of ``dtype``: typed, as ONNX needs)."""
    ops = TapeOps()
    result = build(ops)
    outs = list(result) if isinstance(result, tuple) else [result]
    for out in outs:
        out.dtype = dtype
    return ir.Graph([], outs, nodes=ops.tape.nodes, name=name)


def _cheap(value: ir.Value) -> bool:
    """Values a branch may read from outside: inputs, constants, scalars and short vectors,
    the shape of a tensor that is computed anyway. A vector of a symbolic length is not one:
    TorchScript exports build their 4-D masks as a flattened [B*S*T] gather (and index grids
    whose shape they read), which must run only where they are used."""
    if value.producer() is None or value.const_value is not None:
        return True
    shape = value.shape
    if shape is None or len(shape) > 1:
        return False
    node = value.producer()
    if node.op_type in ("Shape", "Size"):  # unless what it measures is made only for it
        source = node.inputs[0]
        return source is not None and (_cheap(source) or len(source.uses()) > 1)
    return len(shape) == 0 or (isinstance(shape[0], int) and shape[0] <= 8)


def clone_into(ops: TapeOps, value: ir.Value) -> ir.Value:
    """``value`` recomputed inside the branch ``ops`` builds: its producers are copied back to
    cheap values (graph inputs, constants, rank <= 1 shapes), which are read from outside."""
    order = _producers_in_order(value)
    if not order:
        return value
    mapping: dict[int, ir.Value] = {}
    for node in order:
        inputs = [None if v is None else mapping.get(id(v), v) for v in node.inputs]
        attrs = dict(node.attributes)
        if len(node.outputs) == 1:
            outs = [ops.tape.op(node.op_type, inputs, attrs, domain=node.domain,
                                version=node.version)]
        else:
            outs = ops.tape.op_multi_out(node.op_type, inputs, attrs, domain=node.domain,
                                         version=node.version, num_outputs=len(node.outputs))
        for old, new in zip(node.outputs, outs, strict=True):
            if old.type is not None and old.dtype is not None:
                new.type, new.shape = old.type, old.shape
            mapping[id(old)] = new
    return mapping[id(value)]


def _producers_in_order(value: ir.Value) -> list[ir.Node] | None:
    """The nodes to copy for ``value``, producers first; None when it should not be copied
    (a node holding subgraphs, or too many nodes)."""
    order: list[ir.Node] = []
    visiting: set[int] = set()
    stack: list[tuple[ir.Value, bool]] = [(value, False)]
    while stack:
        current, expanded = stack.pop()
        node = current.producer()
        if expanded:
            order.append(node)  # type: ignore[arg-type]
            continue
        if node is None or _cheap(current) or id(node) in visiting:
            continue
        if subgraphs(node) or len(visiting) >= MAX_CLONED_NODES:
            return None
        visiting.add(id(node))
        stack.append((current, True))
        stack.extend((v, False) for v in node.inputs if v is not None)
    return order


def name_values(graph: ir.Graph, prefix: str) -> None:
    """Unique names for every value and node of a subgraph and its own subgraphs: ONNX needs
    names to be unique across nesting levels, which the tape leaves to us."""
    from mha_onnx.rewrite.irutil import all_graphs

    counter = 0
    for sub in all_graphs(graph):
        for value in sub.inputs:
            value.name = f"{prefix}_{counter}"
            counter += 1
        for node in sub:
            node.name = f"{prefix}_{node.op_type}_{counter}"
            for out in node.outputs:
                out.name = f"{prefix}_{counter}"
                counter += 1


def safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in text) or "block"


def scalar_shape(op) -> ir.Value:
    """The shape [] (for Reshape to a scalar)."""
    return op.Constant(value=ir.tensor(np.zeros(0, np.int64)))


def int_const(op, values: list[int] | int, dtype: Any = np.int64) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(values, dtype)))


def none_padded(op, info: SdpaInfo) -> ir.Value:
    """A bool scalar: no key of any row is padded (``info.padded`` is all False)."""
    assert info.padded is not None
    most = op.ReduceMax(op.Cast(info.padded, to=ir.DataType.INT32), keepdims=0)
    return op.Equal(most, int_const(op, 0, np.int32))


def new_key_kept(op, info: SdpaInfo) -> ir.Value:
    """A bool scalar: every row keeps its last key (a step's new token), so no query of a
    decode step has all its keys masked."""
    assert info.padded is not None
    last = op.Slice(op.Cast(info.padded, to=ir.DataType.INT32), int_const(op, [-1]),
                    int_const(op, [2 ** 31]), int_const(op, [1]))
    return op.Equal(op.ReduceMax(last, keepdims=0), int_const(op, 0, np.int32))


def padding_bias(op, info: SdpaInfo) -> ir.Value:
    """[B, 1, 1, T]: 0 for a kept key, the dtype's lowest finite value for a padded one (its
    weight exactly 0 wherever the row keeps a key)."""
    assert info.padded is not None
    lowest = info.const(op, float(np.finfo(info.np_dtype).min))
    return op.Unsqueeze(op.Where(info.padded, lowest, info.const(op, 0.0)),
                        int_const(op, [1, 2]))


def mean_over_keys(op, v: ir.Value, axis: int) -> ir.Value:
    """The mean of V over its key axis (uniform attention weights), keeping that axis."""
    total = op.ReduceSum(v, op.Constant(value_ints=[axis]), keepdims=1)
    return op.Div(total, op.CastLike(seq_dim(op, v, axis), v))


def absorbed_mean(op, info: SdpaInfo, dense: ir.Value, v: ir.Value) -> ir.Value:
    """softmax(s + dense)·V, [B, H, S, Dv], for query rows whose every score the mask's fill
    absorbs (s + fill == fill): uniform weights over each row's keys at the row's highest
    mask value (a key two fills hide, at -inf or far below, gets none); NaN for a row of
    -inf only. ``dense`` [B|1, 1|H, S, T], ``v`` [B, G, T, Dv]."""
    top = op.ReduceMax(dense, op.Constant(value_ints=[-1]), keepdims=1)
    chosen = op.And(op.Equal(dense, top), op.Greater(top, info.const(op, -math.inf)))
    weights = op.Cast(chosen, to=v.dtype or info.query.dtype)
    count = op.ReduceSum(weights, op.Constant(value_ints=[-1]), keepdims=1)
    rep = info.heads // info.kv_heads
    shape = dims(dense)
    one_head = shape is not None and shape[1] == 1
    if not one_head:  # a mask per head (or unknown): V repeated to every head first
        v = repeat_heads(op, v, rep)
    out = op.Div(op.MatMul(weights, v), count)  # [B, G|H, S, Dv]
    return repeat_heads(op, out, rep) if one_head else out


def fully_masked_value(op, info: SdpaInfo, v: ir.Value, v_axis: int) -> ir.Value | None:
    """What the original gives a query whose keys are all masked, broadcastable onto the
    kernel's output; None when the kernel itself computes it (an additive finite fill)."""
    want = info.all_masked_value()
    if want is None:
        return None
    if want in ("nan", "zero"):
        return info.const(op, math.nan if want == "nan" else 0.0)
    return mean_over_keys(op, v, v_axis)


def causal_bias(op, info: SdpaInfo, seq_q: ir.Value, seq_kv: ir.Value) -> ir.Value:
    """[1, 1, S, T]: 0 where key j <= query i, the fill elsewhere (top-left aligned)."""
    ones = op.Expand(op.Constant(value=ir.tensor(np.array(True))),
                     op.Concat(seq_q, seq_kv, axis=0))
    bias = op.Where(op.Trilu(ones, upper=0), info.const(op, 0.0), info.const(op, info.fill))
    return op.Unsqueeze(bias, op.Constant(value_ints=[0, 1]))


def kv_operands(op, info: SdpaInfo) -> tuple[ir.Value, ir.Value, bool]:
    """K and V with every query head's copy, for MultiHeadAttention: their [B, T, H*D]
    sources if both have one, else [B, H, T, D] tensors (MHA takes that layout too).
    Third item: is 3-D."""
    rep = info.heads // info.kv_heads
    if rep == 1:
        k3, v3 = bsd_source(info.key, info.heads), bsd_source(info.value, info.heads)
        if k3 is not None and v3 is not None:
            return k3, v3, True
    k, v = repeat_heads(op, info.key, rep), repeat_heads(op, info.value, rep)
    qd, vd = dims(info.query), dims(info.value)  # Q and V are [B, H, S|T, D]; K may be K^T
    if qd and vd and qd[-1] != vd[-1]:  # ORT's MHA takes K and V of different head sizes
        # only as [B, T, H*D]
        return to_bsd(op, k, info.heads), to_bsd(op, v, info.heads), True
    return k, v, False


def _as_wide_as_scores(op, dense: ir.Value, q3: ir.Value, v: ir.Value, t_axis: int
                       ) -> ir.Value:
    """``dense`` with its last two dims [S, T] as ORT's MHA wants them: expanded, unless its
    static shape already says so (an Expand to the same shape still copies it, every run: a
    shifted window's [B*nW, H, N, N] bias is as large as the scores). Symbolic dims do not
    count: Moonshine's mask is inferred as [.., T] and is one column when the audio is short."""
    have, q, k = dims(dense), dims(q3), dims(v)
    if have and q and k and len(have) == 4 and isinstance(have[2], int) \
            and isinstance(have[3], int) and have[2] == q[1] and have[3] == k[t_axis]:
        return dense
    full = op.Concat(op.Constant(value_ints=[1, 1]), seq_dim(op, q3, 1),
                     seq_dim(op, v, t_axis), axis=0)  # (V: never K^T)
    return op.Expand(dense, full)


def dense_mha(op, info: SdpaInfo, q3: ir.Value, *, lazy: bool) -> ir.Value:
    """The general form: MultiHeadAttention with every mask term added as the original adds
    it (so fully masked rows come out as there; a NaN guard is kept), K/V heads repeated
    (``lazy``: the bias's producers are copied into the branch being built)."""
    k, v, k3d = kv_operands(op, info)
    if info.dense is None:  # the ONNX Attention op's is_causal: no mask tensor to copy
        dense = causal_bias(op, info, seq_dim(op, q3, 1), seq_dim(op, k, 1 if k3d else 2))
    else:
        dense = clone_into(op, info.dense) if lazy else info.dense
    # ORT's MHA wants the bias' last two dims as [S, T]; the original may broadcast either
    # (Moonshine's cross-attention mask, cut to a length ORT's inference cannot relate to
    # the keys, is one column when the audio is short)
    bias = _as_wide_as_scores(op, dense, q3, v, 1 if k3d else 2)
    if info.sink is not None:
        k, v, bias = _sink_key(op, info, q3, k, v, bias, 1 if k3d else 2)
    if info.softcap:
        out = _capped_attention(op, info, q3, k, v, k3d, bias)
    else:
        out = op.MultiHeadAttention(q3, k, v, None, None, bias,
                                    num_heads=info.heads, scale=info.scale, _domain=MS_DOMAIN)
    if info.nan_to_zero:
        out = op.Where(op.IsNaN(out), info.const(op, 0.0), out)
    return out


def kernel_extras(info: SdpaInfo, *, bias: bool = True) -> str:
    """What a form's name lists after its kernel: ``, window 4, softcap 50, bias, sinks``."""
    return ((f", window {info.window}" if info.window else "")
            + (f", softcap {info.softcap:g}" if info.softcap else "")
            + (", bias" if bias and info.bias is not None else "")
            + (", sinks" if info.sink is not None else ""))


def general_kernel(info: SdpaInfo) -> str:
    """What :func:`dense_mha` runs for this block, as the forms name it."""
    return "capped scores (MatMul, Tanh, Softmax) + attention_bias" if info.softcap \
        else "MHA + attention_bias"


def _capped_attention(op, info: SdpaInfo, q3: ir.Value, k: ir.Value, v: ir.Value, k3d: bool,
                      bias: ir.Value) -> ir.Value:
    """Soft-capped attention written out, as MultiHeadAttention has no ``softcap``:
    ``softmax(c·tanh(scale·Q·K^T / c) + bias)·V``, the scores from the cap on in float32
    (as GroupQueryAttention computes them, and Gemma's eager softmax); [B, S, H*Dv]."""
    split = op.Constant(value_ints=[0, 0, info.heads, -1])  # [B, L, H*D] -> [B, L, H, D]
    q = op.Transpose(op.Reshape(q3, split), perm=[0, 2, 1, 3])
    if k3d:
        kt = op.Transpose(op.Reshape(k, split), perm=[0, 2, 3, 1])
        v = op.Transpose(op.Reshape(v, split), perm=[0, 2, 1, 3])
    else:
        kt = op.Transpose(k, perm=[0, 1, 3, 2])
    f32 = ir.DataType.FLOAT
    scores = op.Cast(op.MatMul(q, kt), to=f32)
    cap = op.Constant(value=ir.tensor(np.array(info.softcap, np.float32)))
    scale = op.Constant(value=ir.tensor(np.array(info.scale / info.softcap, np.float32)))
    capped = op.Mul(op.Tanh(op.Mul(scores, scale)), cap)
    probs = op.Softmax(op.Add(capped, op.Cast(bias, to=f32)), axis=-1)
    probs.producer().metadata_props[FORM] = "capped scores"  # (fused: not a block to fuse)
    out = op.MatMul(op.Cast(probs, to=info.query.dtype), v)  # [B, H, S, Dv]
    return op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))


def _sink_key(op, info: SdpaInfo, q3: ir.Value, k: ir.Value, v: ir.Value, bias: ir.Value,
              axis: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """K and V with one more key of zeros (its score q·0 = 0) and the bias with the sink in
    its column: the softmax over it is the original's over the scores and the sink, and the
    zero value adds nothing (rewrite/recognise/attention_sinks.py)."""
    one = op.Constant(value_ints=[1])

    def zero_key(x: ir.Value) -> ir.Value:  # x's first key, times 0: exactly 0 (finite x)
        return op.Mul(op.Slice(x, op.Constant(value_ints=[0]), one,
                               op.Constant(value_ints=[axis])), info.const(op, 0.0))

    k = op.Concat(k, zero_key(k), axis=axis)
    v = op.Concat(v, zero_key(v), axis=axis)
    batch, keys = seq_dim(op, q3, 0), seq_dim(op, bias, 3)
    heads = op.Constant(value_ints=[info.heads])
    bias = op.Expand(bias, op.Concat(batch, heads, seq_dim(op, q3, 1), keys, axis=0))
    sink = op.Expand(op.Reshape(info.sink, op.Constant(value_ints=[1, -1, 1, 1])),
                     op.Concat(batch, heads, seq_dim(op, q3, 1), one, axis=0))
    return k, v, op.Concat(bias, sink, axis=3)


def fix_all_padded(op, info: SdpaInfo, out3: ir.Value, v: ir.Value, v_is_3d: bool) -> ir.Value:
    """Rows of batch entries whose keys are all padded, set to what the original computes."""
    special = fully_masked_value(op, info, v, 1 if v_is_3d else 2)
    if special is None:
        return out3
    if info.all_masked_value() == "mean" and not v_is_3d:  # [B, H, 1, Dv] -> [B, 1, H*Dv]
        special = op.Reshape(op.Transpose(special, perm=[0, 2, 1, 3]),
                             op.Constant(value_ints=[0, 1, -1]))
    assert info.padded is not None
    all_padded = op.ReduceMin(op.Cast(info.padded, to=ir.DataType.INT32),
                              op.Constant(value_ints=[1]), keepdims=1)
    all_padded = op.Cast(op.Unsqueeze(all_padded, op.Constant(value_ints=[2])),
                         to=ir.DataType.BOOL)  # [B, 1, 1]
    return op.Where(all_padded, special, out3)
