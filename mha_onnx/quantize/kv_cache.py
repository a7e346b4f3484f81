"""An int8 KV cache (``quantize --kv-bits 8``) on a shared-cache fusion.

At long contexts a decode step reads more cache than weights (the 16-layer int4 Llama of
docs/bench.md: about 11 of a 17 ms step at 4096 cached positions is attention over the
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
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.errors import ConfigError
from mha_onnx.graph.cache import KV_SCALE as SCALE  # (float32, for GQA)
from mha_onnx.graph.cache import has_int8_cache  # noqa: F401 (its readers' name for it)
from mha_onnx.graph.walk import subgraphs

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
    pairs = cache_pairs(model)
    inputs = {v.name: v for v in model.graph.input}
    kind = inputs[next(iter(pairs))].type.tensor_type.elem_type
    dtype = helper.tensor_dtype_to_np_dtype(kind)
    graph = model.graph
    for past in pairs:
        scale = np.asarray(scales[past], np.float32)
        graph.initializer.append(numpy_helper.from_array(scale, SCALE.format(past)))
        graph.initializer.append(numpy_helper.from_array(scale.astype(dtype),
                                                         SCALE_T.format(past)))
    for bound, name in ((-QMAX, "low"), (QMAX, "high")):
        graph.initializer.append(numpy_helper.from_array(np.array(bound, dtype),
                                                         LIMITS.format(name)))
    for value in graph.input:
        if value.name in pairs:
            value.type.tensor_type.elem_type = TensorProto.INT8
    presents = {present: past for past, present in pairs.items()}
    made = _Rewrite(kind).graph(graph, {p: p for p in pairs}, presents)
    missing = [p for p in presents if p not in made]
    if missing:
        raise ConfigError(f"--kv-bits: the presents {missing[:2]} are not written by the "
                          "cache's GroupQueryAttention or a form it could quantize")
    for value in graph.output:
        if value.name in presents:
            value.type.tensor_type.elem_type = TensorProto.INT8


class _Rewrite:
    """The rewrite of one file: ``kind`` is the model's float type."""

    def __init__(self, kind: int) -> None:
        self.kind, self.count = kind, 0

    def _name(self, base: str) -> str:
        self.count += 1
        return f"{base}_kv{self.count}"

    def graph(self, graph: onnx.GraphProto, caches: Mapping[str, str],
              required: Mapping[str, str], top: bool = True) -> dict[str, str]:
        """Rewrite ``graph``'s nodes; ``caches``: int8 names visible here -> their past;
        ``required``: outputs that must come out int8 -> their past. Returns this graph's
        int8 outputs (name -> past), every required one among them."""
        caches = dict(caches)
        nodes: list[onnx.NodeProto] = []
        floats: dict[str, str] = {}  # int8 name -> its dequantized copy in this graph
        for node in graph.node:
            if node.name.startswith(MARK):  # (ours, from an earlier pass over this branch)
                if node.op_type == "Cast" and node.attribute[0].i == TensorProto.INT8:
                    caches[node.output[0]] = node.name.split("|")[1]
            elif node.op_type == "GroupQueryAttention" and len(node.input) > 4 \
                    and node.input[3] in caches and node.input[4] in caches:
                self._gqa(node, caches)
            elif node.op_type in _CONTROL:
                self._control(node, caches, required)
            elif node.op_type == "Identity" and node.input[0] in caches:
                caches[node.output[0]] = caches[node.input[0]]
            elif node.op_type not in SHAPE_ONLY:
                for i, name in enumerate(node.input):
                    if name in caches:
                        if name not in floats:
                            floats[name] = self._name(name)
                            nodes += self._dequantize(name, caches[name], floats[name])
                        node.input[i] = floats[name]
            nodes.append(node)
        for output in graph.output:
            past = required.get(output.name)
            if past is None or output.name in caches:
                continue
            quantized = output.name if top else self._name(output.name)
            source = self._name(output.name) if top else output.name
            if top:
                _rename_output(nodes, output.name, source)
            nodes += self._quantize(source, past, quantized)
            output.name, caches[quantized] = quantized, past
        del graph.node[:]
        graph.node.extend(nodes)
        made = {o.name: caches[o.name] for o in graph.output if o.name in caches}
        _int8_types(graph, made, caches)
        return made

    def _gqa(self, node: onnx.NodeProto, caches: dict[str, str]) -> None:
        key, value = caches[node.input[3]], caches[node.input[4]]
        for index, past in ((1, key), (2, value)):
            if len(node.output) > index and node.output[index]:
                caches[node.output[index]] = past
        if any(a.name == "kv_cache_bit_width" for a in node.attribute):
            return  # (rewritten in an earlier pass)
        inputs = list(node.input) + [""] * (12 - len(node.input))
        del node.input[:]
        node.input.extend(inputs[:12] + [SCALE.format(key), SCALE.format(value)])
        node.attribute.extend([helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("kv_cache_bit_width", 8)])

    def _control(self, node: onnx.NodeProto, caches: dict[str, str],
                 required: Mapping[str, str]) -> None:
        """An If's branches (a Loop's or Scan's body: its reads only): an output comes out
        int8 where a branch writes it so or the caller needs it so; every branch then
        writes it int8."""
        bodies = subgraphs(node)
        if node.op_type != "If":
            for body in bodies:
                self.graph(body, caches, {}, top=False)
            return
        natural = [self.graph(body, caches, {}, top=False) for body in bodies]
        want: dict[int, str] = {}
        for i, name in enumerate(node.output):
            pasts = [made[body.output[i].name] for body, made in zip(bodies, natural,
                                                                      strict=True)
                     if body.output[i].name in made]
            if name in required or pasts:
                want[i] = required.get(name) or pasts[0]
        for body in bodies:
            self.graph(body, caches, {body.output[i].name: p for i, p in want.items()},
                       top=False)
        for i, past in want.items():
            caches[node.output[i]] = past

    def _node(self, past: str, op: str, inputs: list[str], output: str, **attrs
              ) -> onnx.NodeProto:
        self.count += 1
        return helper.make_node(op, inputs, [output], f"{MARK}|{past}|{self.count}", **attrs)

    def _dequantize(self, name: str, past: str, out: str) -> list[onnx.NodeProto]:
        cast = self._name(name + "_f")
        return [self._node(past, "Cast", [name], cast, to=self.kind),
                self._node(past, "Mul", [cast, SCALE_T.format(past)], out)]

    def _quantize(self, name: str, past: str, out: str) -> list[onnx.NodeProto]:
        scaled, rounded, clipped = (self._name(name + s) for s in ("_s", "_r", "_c"))
        return [self._node(past, "Div", [name, SCALE_T.format(past)], scaled),
                self._node(past, "Round", [scaled], rounded),
                self._node(past, "Clip", [rounded, LIMITS.format("low"),
                                          LIMITS.format("high")], clipped),
                self._node(past, "Cast", [clipped], out, to=TensorProto.INT8)]


def _rename_output(nodes: list[onnx.NodeProto], old: str, new: str) -> None:
    for node in nodes:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


def _int8_types(graph: onnx.GraphProto, made: Mapping[str, str],
                caches: Mapping[str, str]) -> None:
    """The graph's outputs ``made`` int8 typed so; value infos of its int8 names dropped
    (ORT's shape inference finds them again)."""
    for output in graph.output:
        if output.name in made:
            output.type.tensor_type.elem_type = TensorProto.INT8
    kept = [v for v in graph.value_info if v.name not in caches]
    del graph.value_info[:]
    graph.value_info.extend(kept)
