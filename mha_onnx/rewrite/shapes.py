"""Shape facts for graphs that carry none: ONNX Runtime's symbolic shape inference.

TorchScript exports (Optimum's among them) carry no ``value_info`` and compute reshape targets
with ``Shape -> Gather -> Concat`` chains, which ONNX's own shape inference cannot follow: the
attention blocks' Q, K and V then have no known shapes and no rule can read them. ORT's
symbolic shape inference (the maintained implementation its transformers optimizer uses)
evaluates those chains symbolically and names every dim, ``past_sequence_length +
sequence_length`` included, so that recognition does not depend on which exporter wrote the
graph. It runs on a copy; where it fails, the graph is fused with the shapes it has.

Two things are added around it (``_Inference``): ``ReduceMax``/``ReduceMin`` of known shape
data (TorchScript's ``repeat_interleave``, as the interleaved rotary of Cohere, GLM and Helium
spells it, takes the max of a ConstantOfShape to size an Expand: without it the inference
stopped on that Expand and the whole graph went without shapes), and a driver that does not
write ``sym_shape_infer_temp.onnx`` into the working folder when inference is incomplete, as
ORT's own ``infer_shapes`` does.
"""

from __future__ import annotations

import contextlib
import io
import logging

import onnx

from mha_onnx.graph.walk import subgraphs
from mha_onnx.rewrite.constants import constants_folded
from mha_onnx.rewrite.irutil import dims, producer, shape_bounds

log = logging.getLogger(__name__)


def with_symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every value's symbolic shape in ``value_info`` (a copy), or ``model``
    itself when ORT's symbolic shape inference cannot run on it. A graph it cannot take as a
    whole (Optimum's merged decoders: one ``If`` on ``use_cache_branch`` whose branches are
    the decoder with and without a past) gets each branch inferred as a model of its own."""
    inferred = _infer(model)
    if inferred is not None:
        return inferred
    branches = [sub for node in model.graph.node for sub in subgraphs(node)]
    if not branches:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    done = 0
    for node in out.graph.node:
        for sub in subgraphs(node):
            done += _infer_branch(out, sub)
    log.info("symbolic shapes inferred for %d of %d branch(es)", done, len(branches))
    return out


def _infer(model: onnx.ModelProto) -> onnx.ModelProto | None:
    try:
        inference = _inference()
    except ImportError:  # an onnxruntime build without its tools
        return None
    if not model.opset_import or max(o.version for o in model.opset_import
                                     if o.domain in ("", "ai.onnx")) < 7:
        return None
    quiet = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "Cannot determine if ... < 0" reached users' terminals
    folded = constants_folded(model)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            inference._preprocess(folded)
            complete = False
            while inference.run_:
                complete = inference._infer_impl()
            inference._update_output_from_vi()
    except Exception as exc:  # noqa: BLE001 - an optional help; fusing goes on without it
        log.info("symbolic shape inference failed (%s: %s)", type(exc).__name__,
                 str(exc)[:200])
        return None
    finally:
        quiet.setLevel(level)
    if not complete:
        log.info("symbolic shape inference incomplete: fusing with the shapes it found")
    out = inference.out_mp_
    if folded is not model:  # the facts on the graph as it was, not on the folded copy
        del out.graph.node[:]
        out.graph.node.extend(model.graph.node)
    return out


def _inference():
    """ORT's symbolic shape inference, with ReduceMax/ReduceMin of known shape data."""
    import numpy as np
    from onnxruntime.tools import symbolic_shape_infer as ssi

    class _Inference(ssi.SymbolicShapeInference):
        def __init__(self) -> None:
            super().__init__(2**31 - 1, True, False, 0)  # int_max, auto_merge, guess rank
            self.dispatcher_["ReduceMax"] = lambda node: self._reduce(node, max)
            self.dispatcher_["ReduceMin"] = lambda node: self._reduce(node, min)
            self.dispatcher_["Slice"] = lambda node: _slice(self, node, ssi)
            for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
                       "ReduceSumSquare"):  # (Swin-v2's cosine attention: ReduceL2 of q, k)
                self.dispatcher_.setdefault(op, self._reduced_shape)

        def _reduce(self, node, pick) -> None:
            """The max/min of a 1-D vector of known dims (every axis, or axis 0)."""
            self._reduced_shape(node)
            if node.input[0] not in self.sympy_data_:
                return
            data = self.sympy_data_[node.input[0]]
            values = list(np.asarray(data).reshape(-1)) if not isinstance(data, list) else data
            axes = ssi.get_attribute(node, "axes")
            if axes is None and len(node.input) > 1 and node.input[1]:
                axes = self._try_get_value(node, 1)
            if (np.ndim(data) > 1 or not values or not all(ssi.is_literal(v) for v in values)
                    or (axes is not None and list(np.reshape(axes, -1)) not in ([0], [-1]))):
                return
            picked = int(pick(int(v) for v in values))
            keep = ssi.get_attribute(node, "keepdims", 1)
            self.sympy_data_[node.output[0]] = [picked] if keep else picked

        def _reduced_shape(self, node) -> None:
            """The output's shape where ONNX's inference left none (axes an input, opset
            18: GPT-OSS's ``logits - logits.max(-1, keepdim=True)``; without it the
            Sub after it stopped the whole inference)."""
            out = self.known_vi_[node.output[0]]
            if ssi.get_shape_from_type_proto(out.type) is not None:
                return
            axes = ssi.get_attribute(node, "axes")
            if axes is None and len(node.input) > 1 and node.input[1]:
                axes = self._try_get_value(node, 1)
            shape = self._get_shape(node, 0) if node.input[0] in self.known_vi_ else None
            if shape is None or axes is None:
                return
            picked = {ssi.handle_negative_axis(int(a), len(shape))
                      for a in np.reshape(axes, -1)}
            keep = ssi.get_attribute(node, "keepdims", 1)
            dims = [1 if i in picked else d for i, d in enumerate(shape)
                    if keep or i not in picked]
            out.CopyFrom(ssi.helper.make_tensor_value_info(
                node.output[0], self.known_vi_[node.input[0]].type.tensor_type.elem_type, dims))

    return _Inference()


def _slice(inference, node, ssi) -> None:
    """ORT's Slice, except that an end it cannot compare with the input's dim gives the axis
    a new symbol: ORT "treats them as equal", which made Moonshine's mask cut to its conv
    stack's length (``mask[..., ::384][..., :n]``) look uncut, and every dim broadcast
    against it the mask's length."""
    try:
        inference._infer_Slice(node)
    except (AssertionError, TypeError):  # an end whose sign sympy cannot settle (SEW's
        # squeezed length): ORT's own code asserts, which stopped the whole inference
        _fresh_axes(inference, node, ssi)
        return
    assumed = _assumed_axes(inference, node, ssi)
    if not assumed:
        return
    out = inference.known_vi_[node.output[0]]
    shape = ssi.get_shape_from_type_proto(out.type)
    for axis in assumed:
        shape[axis] = str(inference._new_symbolic_dim_from_output(node, 0, axis))
    out.CopyFrom(ssi.helper.make_tensor_value_info(
        node.output[0], out.type.tensor_type.elem_type, shape))


def _fresh_axes(inference, node, ssi) -> None:
    """The Slice's output: its input's shape with a new symbol on every sliced axis."""
    shape = ssi.get_shape_from_sympy_shape(inference._get_sympy_shape(node, 0))
    axes = inference._try_get_value(node, 3) if len(node.input) > 3 and node.input[3] else None
    for axis in ssi.as_list(axes, keep_none=True) if axes is not None else range(len(shape)):
        shape[axis % len(shape)] = str(inference._new_symbolic_dim_from_output(
            node, 0, axis % len(shape)))
    out = inference.known_vi_[node.output[0]]
    out.CopyFrom(ssi.helper.make_tensor_value_info(
        node.output[0], inference.known_vi_[node.input[0]].type.tensor_type.elem_type, shape))


def _assumed_axes(inference, node, ssi) -> list[int]:
    """The axes whose symbolic end ORT could not compare with the symbolic dim."""
    if len(node.input) < 3 or ssi.get_opset(inference.out_mp_) <= 9:
        return []
    ends = ssi.as_list(inference._try_get_value(node, 2), keep_none=True)
    axes = inference._try_get_value(node, 3) if len(node.input) > 3 and node.input[3] else None
    shape = inference._get_sympy_shape(node, 0)
    if ends is None or shape is None:
        return []
    axes = ssi.as_list(axes, keep_none=True) if axes is not None else list(range(len(ends)))
    return [a % len(shape) for a, e in zip(axes, ends, strict=False)
            if e is not None and not ssi.is_literal(e)
            and not ssi.is_literal(shape[a % len(shape)])
            and _order(e, shape[a % len(shape)]) is None]


def _order(end, dim) -> bool | None:
    """Whether ``end <= dim`` is decided for two symbolic sizes (None: it is not)."""
    for test in (lambda: end <= dim, lambda: dim - end >= 0):
        try:
            return bool(test())
        except TypeError:
            continue
    return None


def _infer_branch(model: onnx.ModelProto, branch: onnx.GraphProto) -> int:
    """Infer ``branch`` as a model whose inputs are the outer values it reads (the main
    graph's inputs and initializers); its value_info filled in place. 1 if it worked."""
    inputs = {v.name: v for v in model.graph.input}
    weights = {t.name: t for t in model.graph.initializer}
    inner = {o for n in branch.node for o in n.output} | {t.name for t in branch.initializer}
    used = [name for n in branch.node for name in n.input if name and name not in inner]
    # outputs without their declared shapes: Optimum declares both branches' presents as
    # [.., past + seq, ..], which the branch without a past does not compute
    outputs = [onnx.helper.make_tensor_value_info(o.name, o.type.tensor_type.elem_type, None)
               for o in branch.output]
    graph = onnx.helper.make_graph(list(branch.node), "branch", [], outputs,
                                   initializer=list(branch.initializer))
    for name in dict.fromkeys(used):
        if name in inputs:
            graph.input.append(inputs[name])
        elif name in weights:
            graph.initializer.append(weights[name])
        else:
            return 0  # a value of the outer graph whose shape is not known here
    alone = onnx.helper.make_model(graph, opset_imports=list(model.opset_import),
                                   ir_version=model.ir_version)
    inferred = _infer(alone)
    if inferred is None:
        return 0
    del branch.value_info[:]
    branch.value_info.extend(v for v in inferred.graph.value_info if v.name in inner)
    found = {o.name: o for o in inferred.graph.output}
    for output in branch.output:
        if found.get(output.name) is not None and found[output.name].type.tensor_type.HasField(
                "shape"):
            output.type.CopyFrom(found[output.name].type)
    return 1



def fold_static_dims(model) -> int:
    """``Slice(Shape(x))`` and ``Gather(Shape(x), i)`` whose selected dims are static become
    constants, so that what is computed from them folds too (GPT-2's and Falcon's
    TorchScript exports scale Q and K by ``sqrt(1 / sqrt(Shape(k)[-1]))``: once constant, the
    scale is read as one). Returns how many were folded."""
    import onnx_ir as ir

    from mha_onnx.rewrite.irutil import all_graphs

    folded = 0
    for graph in all_graphs(model.graph):
        for node in list(graph):
            picked = _picked_dims(node)
            if picked is None or node.outputs[0].is_graph_output():
                continue
            constant = ir.node("Constant", [], {"value": ir.tensor(picked)})
            graph.insert_before(node, constant)
            ir.convenience.replace_all_uses_with(node.outputs[0], constant.outputs[0])
            folded += 1
    return folded


def _picked_dims(node):
    """What ``Slice|Gather(Shape(x), ...)`` gives when every dim it selects is static (an
    int64 array), else None."""
    import numpy as np

    shape_node = producer(node.inputs[0], "Shape") if node.inputs else None
    if shape_node is None or shape_node.inputs[0] is None or shape_node.inputs[0].shape is None:
        return None
    every = [d if isinstance(d, int) else -1 for d in shape_node.inputs[0].shape]
    first, last = shape_bounds(shape_node, len(every))
    read = np.array(every[first:last], np.int64)
    axes = _picked_axes(node, len(read))
    if axes is None:
        return None
    picked = read[axes]
    return None if (picked < 0).any() else np.asarray(picked, np.int64)


def _picked_axes(node, rank: int):
    """Which entries of a shape vector of ``rank`` dims ``Gather(shape, i)`` or ``Slice(shape,
    a, b[, 0, step])`` with constant arguments picks: an int array shaped as its output (0-D
    for a scalar Gather); None for anything else."""
    import numpy as np

    from mha_onnx.rewrite.irutil import const_array

    if node.op_type not in ("Slice", "Gather") or node.domain not in ("", "ai.onnx"):
        return None
    args = [const_array(v) if v is not None else None for v in node.inputs[1:]]
    if not args or any(a is None for a, v in zip(args, node.inputs[1:], strict=True)
                       if v is not None):
        return None
    positions = np.arange(rank)
    try:
        if node.op_type == "Gather":
            return np.take(positions, args[0].astype(np.int64), axis=0)
        starts, ends = args[0], args[1]
        axes = args[2] if len(args) > 2 and args[2] is not None else np.array([0])
        steps = args[3] if len(args) > 3 and args[3] is not None else np.ones_like(starts)
        if starts.size != 1 or list(axes.reshape(-1)) not in ([0], [-1]):
            return None
        return positions[int(starts[0]):int(min(ends[0], 2 ** 62)):int(steps[0])]
    except (IndexError, ValueError):
        return None


def probability_shapes(model) -> int:
    """Dims of a Softmax's output read by ``Shape(probs)`` (whole, or picked by a Gather or
    Slice) are read instead from a graph input with the same symbolic dim, or are
    constants: DeBERTa views its probabilities by their own sizes (``probs.view(-1,
    probs.size(-2), probs.size(-1))``), and fusing cannot remove probabilities something else
    reads. A read with a dim that has no such source is left. Returns how many moved."""
    import onnx_ir as ir

    from mha_onnx.rewrite.irutil import all_graphs

    sources: dict[str, tuple[ir.Value, int]] = {}  # symbol -> (graph input, axis)
    for value in model.graph.inputs:
        for axis, d in enumerate(dims(value) or []):
            if isinstance(d, str):
                sources.setdefault(d, (value, axis))
    moved = 0
    for graph in all_graphs(model.graph):
        for shape_node in list(graph):
            source = shape_node.inputs[0] if shape_node.op_type == "Shape" else None
            shape = dims(source)
            if (producer(source, "Softmax") is None or shape is None
                    or shape_node.outputs[0].is_graph_output()):
                continue
            first, last = shape_bounds(shape_node, len(shape))
            read = shape[first:last]
            if _reread(graph, shape_node, read, sources, False):
                moved += 1  # every dim read elsewhere: the Shape itself replaced
                continue
            for use in list(shape_node.outputs[0].uses()):
                picked = _picked_axes(use.node, len(read))
                if picked is not None and picked.ndim <= 1 and _reread(
                        graph, use.node, [read[a] for a in picked.reshape(-1)], sources,
                        picked.ndim == 0):
                    moved += 1
    return moved


def _reread(graph, node, wanted: list, sources: dict, scalar: bool) -> bool:
    """``node``'s output (a 1-D int64 of the ``wanted`` dims; a scalar if ``scalar``) read
    from constants and graph inputs' dims instead; False (nothing changed) where a dim has
    neither or the output is the graph's."""
    import numpy as np
    import onnx_ir as ir

    if not wanted or node.outputs[0].is_graph_output() or not all(
            isinstance(d, int) or d in sources for d in wanted):
        return False
    parts = [ir.node("Constant", [], {"value": ir.tensor(np.array([d], np.int64))})
             if isinstance(d, int) else ir.node("Shape", [sources[d][0]], {
                 "start": sources[d][1], "end": sources[d][1] + 1}) for d in wanted]
    if len(parts) > 1:
        parts.append(ir.node("Concat", [p.outputs[0] for p in parts], {"axis": 0}))
    if scalar:
        parts.append(ir.node("Squeeze", [parts[-1].outputs[0]]))
    graph.insert_before(node, parts)
    ir.convenience.replace_all_uses_with(node.outputs[0], parts[-1].outputs[0])
    return True
