"""Stage 2 in isolation: a graph holding one internal ``mha_onnx.fusion.Sdpa`` node (as stage 1
writes it), lowered by one rule, run on ONNX Runtime and compared with attention computed in
numpy from the same meaning (scale, grouped K/V, causal alignment and window, soft-capping,
padded keys, what a fully masked query gives). No exporter, no recognition."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnxscript.optimizer import remove_unused_nodes
from onnxscript.rewriter import RewriteRuleSet

from mha_onnx.rewrite.forms import Form
from mha_onnx.rewrite.irutil import MS_DOMAIN
from mha_onnx.rewrite.lower.rules import Stage2, lower_to_ort
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.recognise.masks import ABSORBING
from mha_onnx.rewrite.sdpa import FUSION_DOMAIN


@dataclass(frozen=True)
class Meaning:
    """What the Sdpa node computes; the attributes stage 1 would write."""

    heads: int = 4
    kv_heads: int = 4
    head: int = 8
    causal: bool = False
    alignment: str = "square"  # square | top-left | bottom-right
    window: int = 0
    softcap: float = 0.0
    padded: bool = False  # a bool [B, T] padded-keys input
    fill: float = -math.inf  # what a masked score becomes (softmax over all of them)
    nan_to_zero: bool = False
    self_attention: bool = True
    dtype: ir.DataType = ir.DataType.FLOAT
    bias: bool = False  # a position bias input [1, H, S, T] (ALiBi, T5's), added as it is
    mask_terms: int = 1  # 2: the causal and the padding fill added (GPT-Neo: a key both
    # hide gets 2 x fill, -inf for float32's lowest)

    @property
    def mask_kind(self) -> str:
        if self.causal:
            return "causal"
        return "key_padding" if self.padded else "none"

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head)

    @property
    def np_dtype(self) -> type:
        return np.float16 if self.dtype == ir.DataType.FLOAT16 else np.float32


def sdpa_model(m: Meaning, *, dense: bool = True, keys: str = "T") -> ir.Model:
    """Inputs q [B, H, S, D], k and v [B, G, T, D], padded? bool [B, T], dense? [B, 1, S, T]
    (every mask term as one additive bias: the general form's operand); output ``out``.
    ``keys``: the name (or expression) of the key length T."""
    def value(name: str, dtype: ir.DataType, shape: list) -> ir.Value:
        return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))

    inputs = [value("q", m.dtype, ["B", m.heads, "S", m.head]),
              value("k", m.dtype, ["B", m.kv_heads, keys, m.head]),
              value("v", m.dtype, ["B", m.kv_heads, keys, m.head])]
    operands: list[ir.Value | None] = list(inputs)
    if m.padded:
        inputs.append(value("padded", ir.DataType.BOOL, ["B", keys]))
    operands.append(inputs[3] if m.padded else None)
    if m.bias:
        inputs.append(value("bias", m.dtype, [1, m.heads, "S", keys]))
    operands.append(inputs[-1] if m.bias else None)
    if dense and m.mask_kind != "none":
        inputs.append(value("dense", m.dtype, ["B", m.heads if m.bias else 1, "S", keys]))
        operands.append(inputs[-1])
    while operands[-1] is None:
        operands.pop()
    attrs = {"scale": m.scale, "num_heads": m.heads, "kv_heads": m.kv_heads,
             "softcap": m.softcap, "mask_kind": m.mask_kind, "causal": int(m.causal),
             "window": m.window, "alignment": m.alignment if m.causal else "", "fill": m.fill,
             "fill_mode": "add", "nan_to_zero": int(m.nan_to_zero),
             "self_attention": int(m.self_attention), "block": "block0",
             "mask_terms": m.mask_terms}
    node = ir.Node(FUSION_DOMAIN, "Sdpa", operands, attributes=[
        ir.convenience.convert_attribute(k, v) for k, v in attrs.items()], num_outputs=1)
    out = node.outputs[0]
    out.name, out.dtype = "out", m.dtype
    out.shape = ir.Shape(["B", m.heads, "S", m.head])
    graph = ir.Graph(inputs, [out], nodes=[node],
                     opset_imports={"": 23, FUSION_DOMAIN: 1, MS_DOMAIN: 1})
    return ir.Model(graph, ir_version=10)


def lower_for_ort(model: ir.Model, forms: FormPolicy) -> Stage2:
    """Stage 2 for ONNX Runtime (every rule, as fuse runs it); what it made."""
    stage = lower_to_ort(model, forms)
    assert stage.forms, "the lowering did not apply"
    model.opset_imports.pop(FUSION_DOMAIN, None)
    remove_unused_nodes(model)
    return stage


def lower(model: ir.Model, rule_class, *args) -> dict[str, Form]:
    """Apply one lowering rule (``rule_class.rule(forms, *args)``); the forms it chose."""
    forms: dict[str, Form] = {}
    count = RewriteRuleSet([rule_class.rule(forms, *args)]).apply_to_model(model)
    assert count == 1, "the lowering did not apply"
    model.opset_imports.pop(FUSION_DOMAIN, None)
    remove_unused_nodes(model)
    return forms


def ops(model: ir.Model) -> set[str]:
    """Op types in the graph and every branch."""
    found = set()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        found.add(node.op_type)
    return found


def keep_mask(m: Meaning, padded: np.ndarray | None, s: int, t: int) -> np.ndarray:
    """bool [B, 1, S, T]: True where query i may read key j."""
    i, j = np.arange(s)[:, None], np.arange(t)[None, :]
    keep = np.ones((s, t), bool)
    if m.causal:
        offset = t - s if m.alignment == "bottom-right" else 0
        keep &= j <= i + offset
        if m.window:
            keep &= j > i + offset - m.window
    keep = np.broadcast_to(keep, (1, 1, s, t))
    if padded is not None:
        keep = keep & ~padded[:, None, None, :]
    return keep


def feeds(m: Meaning, batch: int, s: int, t: int, padded: np.ndarray | None = None,
          seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"q": rng.standard_normal((batch, m.heads, s, m.head)),
           "k": rng.standard_normal((batch, m.kv_heads, t, m.head)),
           "v": rng.standard_normal((batch, m.kv_heads, t, m.head))}
    out = {k: v.astype(m.np_dtype) for k, v in out.items()}
    if m.padded:
        out["padded"] = padded if padded is not None else np.zeros((batch, t), bool)
    if m.bias:
        out["bias"] = rng.standard_normal((1, m.heads, s, t)).astype(m.np_dtype)
    if m.mask_kind != "none":  # every term: the mask and the bias
        keep = np.broadcast_to(keep_mask(m, out.get("padded"), s, t), (batch, 1, s, t))
        if m.mask_terms == 2:  # the causal term, then the padding term added in the dtype
            seen = keep_mask(m, None, s, t)
            fill = m.np_dtype(m.fill)
            with np.errstate(over="ignore"):
                out["dense"] = (np.where(seen, 0, fill).astype(m.np_dtype) + np.where(
                    out["padded"][:, None, None, :], fill, 0).astype(m.np_dtype))
        else:
            out["dense"] = (np.where(keep, 0.0, m.fill) + out.get("bias", 0.0)).astype(m.np_dtype)
    return out


def reference(m: Meaning, f: dict[str, np.ndarray]) -> np.ndarray:
    """Attention in float64 with the original's fully-masked behaviour: softmax over scores
    that are all ``fill`` (NaN for -inf, or a NaN guard's 0; uniform for a finite fill)."""
    q, k, v = (f[n].astype(np.float64) for n in ("q", "k", "v"))
    rep = m.heads // m.kv_heads
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * m.scale
    if m.softcap:
        scores = m.softcap * np.tanh(scores / m.softcap)
    scores = scores + f.get("bias", 0.0)
    keep = keep_mask(m, f.get("padded"), q.shape[2], k.shape[2])
    if m.fill <= ABSORBING:  # float32 scores absorb it: every masked score is the fill
        # (or the fills that add up there)
        scores = np.where(keep, scores, f["dense"] if m.mask_terms == 2 else m.fill)
    else:  # a finite fill added (softmax(s + fill) where every key is masked), rounded as
        added = (scores.astype(m.np_dtype) + m.np_dtype(m.fill)).astype(np.float64)  # the graph
        scores = np.where(keep, scores, added)
    with np.errstate(invalid="ignore"):
        shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = shifted / shifted.sum(axis=-1, keepdims=True)
    out = probs @ v
    return np.nan_to_num(out, nan=0.0) if m.nan_to_zero else out


def run(model: ir.Model, f: dict[str, np.ndarray]) -> np.ndarray:
    proto = ir.to_proto(model)
    names = {i.name for i in proto.graph.input}
    session = ort.InferenceSession(proto.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {k: v for k, v in f.items() if k in names})[0]


def assert_matches(got: np.ndarray, want: np.ndarray, atol: float = 2e-5) -> None:
    """Equal where the reference is finite, NaN exactly where it is NaN."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), atol=atol, rtol=1e-3)


def cached_model(m: Meaning) -> ir.Model:
    """A causal layer with a KV cache as stage 1 leaves it: keys and values are
    ``Concat(past, new)`` on the sequence axis, also the model's ``present_*`` outputs, and
    the Sdpa node is aligned to the end of the keys (``bottom-right``). Inputs q, past_k,
    new_k, past_v, new_v (padded? [B, P + S], dense [B, 1, S, P + S])."""
    assert m.causal and m.alignment == "bottom-right"
    model = sdpa_model(m)
    graph = model.graph
    sdpa = next(iter(graph))
    for index, name in ((1, "k"), (2, "v")):
        whole = sdpa.inputs[index]
        past = ir.Value(name=f"past_{name}", type=ir.TensorType(m.dtype),
                        shape=ir.Shape(["B", m.kv_heads, "P", m.head]))
        new = ir.Value(name=f"new_{name}", type=ir.TensorType(m.dtype),
                       shape=ir.Shape(["B", m.kv_heads, "S", m.head]))
        concat = ir.Node("", "Concat", [past, new], attributes=[ir.AttrInt64("axis", 2)])
        present = concat.outputs[0]
        present.name, present.dtype = f"present_{name}", m.dtype
        present.shape = ir.Shape(["B", m.kv_heads, "T", m.head])
        graph.insert_before(sdpa, concat)
        sdpa.replace_input_with(index, present)
        graph.inputs[graph.inputs.index(whole)] = past
        graph.inputs.append(new)
        graph.outputs.append(present)
    return model


def cached_feeds(m: Meaning, batch: int, past: int, s: int, padded: np.ndarray | None = None,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for :func:`cached_model` and, under "k"/"v", the whole keys for the reference."""
    f = feeds(m, batch, s, past + s, padded, seed)
    for name in ("k", "v"):
        f[f"past_{name}"] = np.ascontiguousarray(f[name][:, :, :past])
        f[f"new_{name}"] = np.ascontiguousarray(f[name][:, :, past:])
    return f


def run_all(model: ir.Model, f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output by name."""
    proto = ir.to_proto(model)
    names = {i.name for i in proto.graph.input}
    session = ort.InferenceSession(proto.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    outs = session.run(None, {k: v for k, v in f.items() if k in names})
    return {o.name: v for o, v in zip(proto.graph.output, outs, strict=True)}
