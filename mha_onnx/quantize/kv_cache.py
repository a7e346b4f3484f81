"""An int8 KV cache (``quantize --kv-bits 8``) on a shared-cache fusion.

At long contexts a decode step reads more cache than weights (the 16-layer int4 Llama of
docs/history/bench-notebook.md: about 11 of a 17 ms step at 4096 cached positions is attention over the
cache). ONNX Runtime 1.31's CPU GroupQueryAttention reads and writes an int8 cache on a
shared buffer itself (``k_quant_type``/``v_quant_type`` PER_CHANNEL, ``kv_cache_bit_width``
8, a float32 scale per K/V head and channel at inputs 12 and 13): one node measured
0.49-0.56x of the float cache's step at 1024-8192 positions, cosine 0.9998
(tools/experiments/kv_quant.py).

The scales: symmetric, each (K/V head, channel)'s largest magnitude in the float model's
presents over calibration prompts, over 127 (keys carry outlier channels: one scale per
tensor loses them). The rewrite, in every graph of the file (a fusion's Ifs hold several
GroupQueryAttention per layer and a general form):

- the past inputs and present outputs become int8 (one buffer bound as both, as before);
- every GroupQueryAttention reading a past reads it as int8 with the scales;
- any other node reading an int8 cache (the general form's Slice and Concat) reads it
  dequantized (Cast, times the scale) in the branch where it runs, so a decode step that
  takes the fast branch never converts the buffer;
- a branch whose present comes out float (the general form) writes it quantized (divided
  by the scale, rounded, clipped to [-127, 127]) where an If's other branch writes int8.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, numpy_helper

from mha_onnx.errors import ConfigError
from mha_onnx.graph.cache import KV_SCALE as SCALE  # (float32, for GQA)
from mha_onnx.graph.cache import has_int8_cache  # noqa: F401 (its readers' name for it)

QMAX = 127.0
SCALE_T = "{}_kv_scale_t"  # the scale in the model's float type
LIMITS = "kv_int8_{}"  # -127 / 127 in the model's float type
SHAPE_ONLY = {"Shape", "Size"}
MARK = "kv_int8"  # the nodes this module adds: MARK|past|n
_CONTROL = {"If", "Loop", "Scan"}


def calibrate(presents: Mapping[str, np.ndarray], pairs: Mapping[str, str]
              ) -> dict[str, np.ndarray]:
    """past name -> float32 [1, kv_heads, 1, head_size]: each (head, channel)'s largest
    magnitude in its present over every row and position, over 127."""
    scales = {}
    for past, present in pairs.items():
        cache = np.nan_to_num(np.asarray(presents[present], np.float32))
        peak = np.abs(cache).max(axis=(0, 2), keepdims=True)
        scales[past] = np.maximum(peak / QMAX, np.float32(1e-8)).astype(np.float32)
    return scales


def kv_scales(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """past name -> its scale, in a model quantize_cache rewrote ({} in any other)."""
    from mha_onnx.graph.cache import cache_pairs

    inits = {t.name: t for t in model.graph.initializer}
    return {past: numpy_helper.to_array(inits[SCALE.format(past)])
            for past in cache_pairs(model) if SCALE.format(past) in inits}


def dequantized(model: onnx.ModelProto, outputs: Mapping[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
    """``outputs`` of ``model`` with its int8 presents as float32 values (times the scale)."""
    from mha_onnx.graph.cache import cache_pairs

    scales = kv_scales(model)
    out = dict(outputs)
    for past, present in cache_pairs(model).items():
        if past in scales and present in out and out[present].dtype == np.int8:
            out[present] = out[present].astype(np.float32) * scales[past]
    return out


def cache_feeds(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
    """``feeds`` as ``model`` takes them: empty or zero pasts in int8 where its cache is."""
    if not has_int8_cache(model):
        return dict(feeds)
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    return {k: v.astype(np.int8) if types.get(k) == TensorProto.INT8 else v
            for k, v in feeds.items()}


def require_shared(model: onnx.ModelProto) -> None:
    from mha_onnx.graph.cache import cache_pairs, is_shared

    if not (cache_pairs(model) and is_shared(model)):
        raise ConfigError("--kv-bits needs a decoder fused with --kv-cache shared (one buffer "
                          "per cache, read and written in place by GroupQueryAttention)",
                          hint="mha-onnx fuse MODEL -o OUT --kv-cache shared, then quantize it")
    if has_int8_cache(model):
        raise ConfigError("--kv-bits: the model's cache is int8 already")


def quantize_cache(model: onnx.ModelProto, scales: Mapping[str, np.ndarray]) -> None:
    """Rewrite ``model`` (in place) to keep its caches in int8 (see the module docstring)."""
    from mha_onnx.graph.cache import cache_pairs

    require_shared(model)
    rewritten = ir.from_proto(model)
    Int8Cache(cache_pairs(model), scales)(rewritten)
    model.CopyFrom(ir.to_proto(rewritten))


class Int8Cache(ir.passes.InPlacePass):
    """The rewrite (module docstring) as an onnx-ir pass: ``pairs`` past -> present names,
    ``scales`` past -> its float32 scale. Cache values are followed as value objects through
    every graph (a branch reads the main graph's past as the same object); the nodes it adds
    are named ``MARK|past|n``, so a second pass over a branch knows them."""

    def __init__(self, pairs: Mapping[str, str], scales: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        self.pairs, self.scales, self.count = dict(pairs), scales, 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        inputs = {v.name: v for v in graph.inputs}
        self.kind = inputs[next(iter(self.pairs))].dtype
        dtype = self.kind.numpy()
        self.consts: dict[str, ir.Value] = {}
        for past in self.pairs:
            scale = np.asarray(self.scales[past], np.float32)
            self._const(graph, SCALE.format(past), scale)
            self._const(graph, SCALE_T.format(past), scale.astype(dtype))
        for bound, name in ((-QMAX, "low"), (QMAX, "high")):
            self._const(graph, LIMITS.format(name), np.array(bound, dtype))
        for name in self.pairs:
            inputs[name].dtype = ir.DataType.INT8
        outputs = {v.name: i for i, v in enumerate(graph.outputs)}
        required = {outputs[present]: past for past, present in self.pairs.items()
                    if present in outputs}
        made = self._graph(graph, {inputs[p]: p for p in self.pairs}, required, top=True)
        missing = [graph.outputs[i].name for i in required if i not in made]
        if missing or len(required) < len(self.pairs):
            raise ConfigError(f"--kv-bits: the presents {missing[:2]} are not written by the "
                              "cache's GroupQueryAttention or a form it could quantize")
        return ir.passes.PassResult(model, modified=True)

    def _const(self, graph: ir.Graph, name: str, array: np.ndarray) -> None:
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        graph.register_initializer(value)
        self.consts[name] = value

    def _graph(self, graph: ir.Graph, caches: Mapping[ir.Value, str],
               required: Mapping[int, str], top: bool = False) -> dict[int, str]:
        """Rewrite ``graph``'s nodes; ``caches``: int8 values visible here -> their past;
        ``required``: output indices that must come out int8 -> their past. Returns this
        graph's int8 outputs (index -> past), every required one among them."""
        caches = dict(caches)
        wanted = {graph.outputs[i]: past for i, past in required.items()}
        floats: dict[ir.Value, ir.Value] = {}  # int8 value -> its dequantized copy here
        for node in list(graph):
            if node.name and node.name.startswith(MARK):  # ours, from an earlier pass
                if node.op_type == "Cast" and node.attributes["to"].value == ir.DataType.INT8:
                    caches[node.outputs[0]] = node.name.split("|")[1]
            elif node.op_type == "GroupQueryAttention" and len(node.inputs) > 4 \
                    and node.inputs[3] in caches and node.inputs[4] in caches:
                self._gqa(node, caches)
            elif node.op_type in _CONTROL:
                self._control(node, caches, wanted)
            elif node.op_type == "Identity" and node.inputs[0] in caches:
                caches[node.outputs[0]] = caches[node.inputs[0]]
            elif node.op_type not in SHAPE_ONLY:
                for i, value in enumerate(node.inputs):
                    if value in caches:
                        if value not in floats:
                            floats[value] = self._dequantize(graph, node, value, caches[value])
                        node.replace_input_with(i, floats[value])
        for index, past in required.items():
            if graph.outputs[index] not in caches:
                caches[self._quantize(graph, index, past, top)] = past
        for value in caches:
            if value.producer() is not None or value.is_graph_input():
                value.dtype = ir.DataType.INT8
        return {i: caches[v] for i, v in enumerate(graph.outputs) if v in caches}

    def _name(self, past: str) -> str:
        self.count += 1
        return f"{MARK}|{past}|{self.count}"

    def _gqa(self, node: ir.Node, caches: dict[ir.Value, str]) -> None:
        key, value = caches[node.inputs[3]], caches[node.inputs[4]]
        for index, past in ((1, key), (2, value)):
            if len(node.outputs) > index:
                caches[node.outputs[index]] = past
        if "kv_cache_bit_width" in node.attributes:
            return  # (rewritten in an earlier pass)
        node.resize_inputs(14)  # (the scales at 12 and 13)
        node.replace_input_with(12, self.consts[SCALE.format(key)])
        node.replace_input_with(13, self.consts[SCALE.format(value)])
        for name, given in (("k_quant_type", "PER_CHANNEL"), ("v_quant_type", "PER_CHANNEL")):
            node.attributes[name] = ir.AttrString(name, given)
        node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 8)

    def _control(self, node: ir.Node, caches: dict[ir.Value, str],
                 wanted: Mapping[ir.Value, str]) -> None:
        """An If's branches (a Loop's or Scan's body: its reads only): an output comes out
        int8 where a branch writes it so or the caller needs it so; every branch then
        writes it int8."""
        bodies = [a.as_graph() for a in node.attributes.values()
                  if a.type == ir.AttributeType.GRAPH]
        if node.op_type != "If":
            for body in bodies:
                self._graph(body, caches, {})
            return
        natural = [self._graph(body, caches, {}) for body in bodies]
        want = {}
        for i, out in enumerate(node.outputs):
            pasts = [made[i] for made in natural if i in made]
            if out in wanted or pasts:
                want[i] = wanted.get(out) or pasts[0]
        for body in bodies:
            self._graph(body, caches, want)
        for i, past in want.items():
            caches[node.outputs[i]] = past

    def _dequantize(self, graph: ir.Graph, before: ir.Node, value: ir.Value,
                    past: str) -> ir.Value:
        cast = ir.node("Cast", [value], {"to": self.kind}, name=self._name(past))
        times = ir.node("Mul", [cast.outputs[0], self.consts[SCALE_T.format(past)]],
                        name=self._name(past))
        for step in (cast, times):
            step.outputs[0].name = f"{step.name}_out"
        graph.insert_before(before, [cast, times])
        return times.outputs[0]

    def _quantize(self, graph: ir.Graph, index: int, past: str, top: bool) -> ir.Value:
        """Output ``index`` divided by the scale, rounded, clipped and cast to int8, the
        graph's output now (under the output's name where ``top``)."""
        value = graph.outputs[index]
        steps, current = [], value
        for op, extra in (("Div", [self.consts[SCALE_T.format(past)]]), ("Round", []),
                          ("Clip", [self.consts[LIMITS.format("low")],
                                    self.consts[LIMITS.format("high")]])):
            step = ir.node(op, [current, *extra], name=self._name(past))
            step.outputs[0].name = f"{step.name}_out"
            steps.append(step)
            current = step.outputs[0]
        cast = ir.node("Cast", [current], {"to": ir.DataType.INT8}, name=self._name(past))
        quantized = cast.outputs[0]
        quantized.shape = value.shape
        graph.extend([*steps, cast])
        name = value.name
        graph.outputs[index] = quantized
        if top:
            value.name, quantized.name = f"{name}_float", name
        else:
            quantized.name = f"{cast.name}_out"
        return quantized
