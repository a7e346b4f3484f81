"""One run for a decode step and a joining prompt's chunk: the step's rows and the chunk's
tokens as one sequence through every per-token op (the MatMuls read each weight once for
both), split only at the attention.

A running stream waits, between two of its tokens, for whatever runs between two steps: with
``--prefill-chunk``, a joining request's chunk run alone at batch 1 (which reads every weight
again) and then the step. :func:`mixed_graph` makes, from a shared-cache fusion with per-row
lengths, a graph whose ``input_ids``/``position_ids`` are ``[1, R + S]``: the R running rows'
new tokens, then the S tokens of one row's chunk. Each layer's GroupQueryAttention of the
decode step (decode.py's graph: every ``If`` at its GQA branch) becomes two: the first R
positions as R rows of one token each, over the running rows' buffers (the model's pasts,
bound to the first R slots, as a step binds them), and the last S positions as one row
after its cached positions, over :func:`chunk_name` pasts (bound to the joining row's slot):
the kernels and per-row lengths the step and a chunk run alone take. The LM head reads only
the positions :data:`LAST` names (each running row's, and the chunk's last), gathered where
the head reads its hidden states (a head that quantizes its input: at the last norm's
output, so that the per-position scales are computed on the positions kept).

Exact where the chunk alone and the step alone are and where every op outside the attention
computes each position alone (a w8a8 file's activations are quantized per position): a
row's tokens do not depend on what shares its run. Nothing here proves that for a graph;
mixing.py's probe checks it on every file before a server mixes. The lengths come in as
inputs (:data:`STEP_LENGTHS` ...) where the step reads them from its mask.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from mha_onnx.generate.decode import GUARD, decode_graph
from mha_onnx.graph.decoder import LOGITS
from mha_onnx.rewrite.irutil import MS_DOMAIN
from mha_onnx.rewrite.lower.common import TapeOps, int_const

STEP_LENGTHS = "mixed_step_seqlens"  # int32 [R]: each running row's kept keys - 1, after it
STEP_TOTAL = "mixed_step_total"  # int32 []: the step's mask length (longest row + 1)
CHUNK_LENGTHS = "mixed_chunk_seqlens"  # int32 [1]: the chunk row's positions - 1, after it
CHUNK_TOTAL = "mixed_chunk_total"  # int32 []: the chunk row's positions after it
LAST = "mixed_last_positions"  # int64 [R + 1]: the positions whose logits come back
_WIDE = 2 ** 62


def chunk_name(name: str) -> str:
    """The chunk row's past (or present) of the model's past (or present) ``name``."""
    return f"mixed_chunk.{name}"


def mixed_graph(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The mixed graph of a shared-cache fusion with per-row lengths (module doc), or None
    where its decode steps are not one GroupQueryAttention per layer on the model's own
    pasts, without a bias, or no norm comes before its logits."""
    decode = decode_graph(model)
    if decode is None:
        return None
    made = ir.from_proto(decode)
    graph = made.graph
    nodes = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    logits = next((v for v in graph.outputs if v.name == LOGITS), None)
    if not nodes or logits is None or not all(_splittable(n) for n in nodes):
        return None
    fed = {name: _input(graph, name, dtype, shape) for name, dtype, shape in (
        (STEP_LENGTHS, ir.DataType.INT32, ["rows"]), (STEP_TOTAL, ir.DataType.INT32, []),
        (CHUNK_LENGTHS, ir.DataType.INT32, [1]), (CHUNK_TOTAL, ir.DataType.INT32, []),
        (LAST, ir.DataType.INT64, ["last"]))}
    if not _read_last(graph, fed[LAST]):
        return None
    for node in nodes:
        _split(graph, node, fed)
    guard = next((v for v in graph.outputs if v.name == GUARD), None)
    if guard is not None:
        graph.outputs.remove(guard)
    common_passes.RemoveUnusedNodesPass()(made)
    used = {v.name for n in ir.traversal.RecursiveGraphIterator(graph) for v in n.inputs
            if v is not None}
    graph.inputs[:] = [v for v in graph.inputs if v.name in used]
    return ir.to_proto(made)


def _splittable(node: ir.Node) -> bool:
    """A step's GQA on the model's own past buffers, presents out, without a bias."""
    inputs = list(node.inputs) + [None] * (12 - len(node.inputs))
    return (inputs[3] is not None and inputs[3].is_graph_input() and inputs[4] is not None
            and inputs[4].is_graph_input() and inputs[10] is None
            and all(v.is_graph_output() for v in node.outputs[1:3]))


def _input(graph: ir.Graph, name: str, dtype: ir.DataType, shape: list) -> ir.Value:
    value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
    graph.inputs.append(value)
    return value


def _split(graph: ir.Graph, node: ir.Node, fed: dict[str, ir.Value]) -> None:
    """``node`` (a step's GQA over [1, R + S] positions) as the running rows' GQA over the
    first R and the chunk row's over the last S, its output both joined again."""
    ops = TapeOps()
    rows = ops.Shape(node.inputs[3], start=0, end=1)  # [1]: R
    axis = int_const(ops, [1])

    def step_part(x, shape):  # [1, R, C] -> [R, 1, C] (or [1, R] -> [R, 1])
        return ops.Reshape(ops.Slice(x, int_const(ops, [0]), rows, axis), int_const(ops, shape))

    def chunk_part(x):
        return ops.Slice(x, rows, int_const(ops, [_WIDE]), axis)

    inputs = list(node.inputs)
    step_in, chunk_in = list(inputs), list(inputs)
    for i in (0, 1, 2):
        if inputs[i] is not None:
            step_in[i], chunk_in[i] = step_part(inputs[i], [-1, 1, 0]), chunk_part(inputs[i])
    if len(inputs) > 9 and inputs[9] is not None:  # position_ids [1, R + S]
        step_in[9], chunk_in[9] = step_part(inputs[9], [-1, 1]), chunk_part(inputs[9])
    step_in[5], step_in[6] = fed[STEP_LENGTHS], fed[STEP_TOTAL]
    chunk_in[5], chunk_in[6] = fed[CHUNK_LENGTHS], fed[CHUNK_TOTAL]
    for i in (3, 4):
        past = inputs[i]
        chunk_in[i] = _input(graph, chunk_name(past.name), past.type.dtype,
                             [1, *list(past.shape)[1:]])
    attrs = {a.name: a for a in node.attributes.values()}
    step = ops.GroupQueryAttention(*step_in, _domain=MS_DOMAIN, _outputs=3, **attrs)
    chunk = ops.GroupQueryAttention(*chunk_in, _domain=MS_DOMAIN, _outputs=3, **attrs)
    joined = ops.Concat(ops.Reshape(step[0], int_const(ops, [1, -1, 0])), chunk[0], axis=1)
    graph.insert_before(node, ops.tape.nodes)
    out, present_key, present_value = node.outputs
    out.replace_all_uses_with(joined)
    for old, new, chunk_present in ((present_key, step[1], chunk[1]),
                                    (present_value, step[2], chunk[2])):
        name, old.name = old.name, None
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        new.name, chunk_present.name = name, chunk_name(name)
        graph.outputs.append(chunk_present)
    graph.remove(node, safe=True)


_HEADS = {"MatMul", "MatMulNBits", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "Gemm"}
_QUANTIZED_INPUT = {"MatMulIntegerToFloat", "MatMulInteger"}  # (A quantized in the graph)


def _head_input(logits: ir.Value) -> ir.Value | None:
    """The hidden states the LM head reads: up from ``logits`` along each node's first
    non-constant input to a MatMul with a constant weight, then its input (where the graph
    quantizes that input itself, the nearest normalization's output above it, so that its
    per-position scales are computed on the positions kept), or None."""
    value = logits
    while (node := value.producer()) is not None:
        if node.op_type in _HEADS and len(node.inputs) > 1 and _constant(node.inputs[1]):
            if node.op_type in _QUANTIZED_INPUT:
                return _norm_above(node.inputs[0])
            return node.inputs[0]
        data = [v for v in node.inputs if v is not None and not _constant(v)]
        if not data:
            return None
        value = data[0]
    return None


def _norm_above(value: ir.Value) -> ir.Value | None:
    """The output of the nearest normalization ``value`` is computed from (a quantized
    head's input: its scales per position computed after it), or None."""
    seen, todo = set(), [value]
    while todo:
        node = todo.pop(0).producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in _NORMS:
            return node.outputs[0]
        todo += [v for v in node.inputs if v is not None and not _constant(v)]
    return None


_NORMS = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
          "LayerNormalization", "SkipLayerNormalization", "RMSNormalization"}


def _constant(value: ir.Value) -> bool:
    return value.is_initializer() or value.const_value is not None or (
        value.producer() is not None and value.producer().op_type == "Constant")


def _read_last(graph: ir.Graph, last: ir.Value) -> bool:
    """The positions ``last`` names gathered where the LM head reads its hidden states, so
    that it computes those only: [1, R + 1, vocab] logits. False where no LM head is found
    (whether what lies between it and the logits works on each position alone, the probe
    in mixing.py shows)."""
    for node in list(graph):  # (--logits last: its one position per row, undone)
        if node.op_type == "GatherElements" and (node.outputs[0].name or "").endswith(
                "_last_position"):
            node.outputs[0].replace_all_uses_with(node.inputs[0])
    logits = next(v for v in graph.outputs if v.name == LOGITS)
    hidden = _head_input(logits)
    if hidden is None:
        return False
    users = list(hidden.uses())  # (before the Gather reads it too)
    ops = TapeOps()
    picked = ops.Gather(hidden, last, axis=1)
    if hidden.producer() is not None:
        graph.insert_after(hidden.producer(), ops.tape.nodes)
    else:  # (a graph input)
        graph.insert_before(next(iter(graph)), ops.tape.nodes)
    for user, index in users:
        user.replace_input_with(index, picked)
    logits.shape = ir.Shape([1, "last", *(list(logits.shape)[2:] if logits.shape else [])])
    return True
