"""Reading a graph with the facts: inputs, initializers and nodes in order, If branches in
place, each node by the first that can read it (its value evaluated, an operator of ours,
ONNX's own per-node inference); then the facts written back as value_info."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import sympy
from onnx import helper, numpy_helper

from mha_onnx.graph.symbolic.data_ops import OPS as DATA_OPS
from mha_onnx.graph.symbolic.facts import DATA_MAX, INTS, Facts, parse_dim, symbol
from mha_onnx.graph.symbolic.shape_ops import OPS as SHAPE_OPS

log = logging.getLogger(__name__)
OPS = {**DATA_OPS, **SHAPE_OPS}


class Inference(Facts):
    """A model's facts, read from its graphs."""

    def declare(self, value: onnx.ValueInfoProto, graph_input: bool = False) -> None:
        tensor = value.type.tensor_type if value.type.HasField("tensor_type") else None
        if tensor is None:
            return
        shape = None
        if tensor.HasField("shape"):
            shape = [_read(d, lambda axis=axis: symbol(f"{value.name}_d{axis}"))
                     for axis, d in enumerate(tensor.shape.dim)]
            if graph_input:
                self.kept.update(s for d in shape for s in d.free_symbols)
        self.set(value.name, tensor.elem_type, shape)

    def initializer(self, tensor: onnx.TensorProto) -> None:
        data = None
        if int(np.prod(tensor.dims)) <= DATA_MAX:
            array = numpy_helper.to_array(tensor)
            if tensor.data_type in INTS:
                data = array.astype(np.int64)
            elif array.dtype.kind == "f":
                self.floats[tensor.name] = array
        self.set(tensor.name, tensor.data_type, list(tensor.dims), data)

    def graph(self, graph: onnx.GraphProto) -> None:
        for tensor in graph.initializer:
            self.initializer(tensor)
        for value in graph.input:
            if value.name not in self.shapes:
                self.declare(value, graph_input=True)
        outer, self.declared = self.declared, {
            v.name: v for v in graph.value_info if v.type.tensor_type.HasField("shape")}
        for node in graph.node:
            self.node(node)
            for name in node.output:
                if name in self.declared:
                    self.reconcile(name, self.declared[name])
        self.declared = outer

    def reconcile(self, name: str, declared: onnx.ValueInfoProto) -> None:
        """A shape the file declares (torch.export writes torch's own symbolic shapes) is
        taken where ours has a symbol of our own making and the file's is in the inputs'
        symbols (our symbol merged into it); ours is kept where it is in the inputs' terms."""
        dims = [_read(d) for d in declared.type.tensor_type.shape.dim]
        ours = self.shape(name)
        if ours is None or len(ours) != len(dims):
            if all(d is not None for d in dims):
                self.set(name, self.elems.get(name) or declared.type.tensor_type.elem_type,
                         dims)
            return
        out = []
        for mine, theirs in zip(ours, dims, strict=True):
            if (theirs is None or mine.free_symbols <= self.kept
                    or not theirs.free_symbols <= self.kept):
                out.append(mine)
                continue
            if mine.is_Symbol:
                self.merged[mine] = theirs
            out.append(theirs)
        self.shapes[name] = out

    def node(self, node: onnx.NodeProto) -> None:
        standard = node.domain in ("", "ai.onnx")
        try:
            if standard and node.op_type == "If":
                self.branches(node)
            elif not (standard and self.evaluated(node)):
                handler = OPS.get(node.op_type) if standard else None
                (handler or Inference.onnx_inference)(self, node)
        except Exception as exc:  # noqa: BLE001 - one node unread; the rest goes on
            log.debug("shape of %s (%s) not inferred: %s", node.name, node.op_type, exc)
        for name in node.output:
            if name and self.shapes.get(name) is None:
                self.unknown += 1
                self.shapes.setdefault(name, None)

    def evaluated(self, node: onnx.NodeProto) -> bool:
        """A node whose inputs are all known small integers, evaluated: True if it was."""
        from onnx.reference import ReferenceEvaluator

        inputs = [x for x in node.input if x]
        if (not inputs or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                              for a in node.attribute)):
            return False
        values = {x: self.literal(x) for x in inputs}
        if any(v is None for v in values.values()):
            return False
        feeds = {x: v.astype(onnx.helper.tensor_dtype_to_np_dtype(self.elems[x]))
                 for x, v in values.items()}
        try:
            results = ReferenceEvaluator(node).run(None, feeds)
        except Exception:  # noqa: BLE001 - read symbolically instead
            return False
        for name, result in zip(node.output, results, strict=False):
            result = np.asarray(result)
            data = result.astype(np.int64) if result.dtype.kind in "iub" else None
            self.set(name, helper.np_dtype_to_tensor_dtype(result.dtype), list(result.shape),
                     data)
        return True

    def onnx_inference(self, node: onnx.NodeProto) -> None:
        """ONNX's own inference of one node, symbolic dims given as text."""
        schema = onnx.defs.get_schema(node.op_type, self.opset, node.domain or "")
        types, data = {}, {}
        for x in node.input:
            if x and x in self.elems:
                types[x] = self.type_proto(x)
                found = self.literal(x)
                if found is not None:
                    np_type = onnx.helper.tensor_dtype_to_np_dtype(self.elems[x])
                    data[x] = numpy_helper.from_array(found.astype(np_type), x)
        outputs = onnx.shape_inference.infer_node_outputs(
            schema, node, types, data, opset_imports=self.opsets)
        for k, name in enumerate(node.output):
            found = outputs.get(name)
            if found is None or not found.HasField("tensor_type"):
                continue
            tensor = found.tensor_type
            shape = None
            if tensor.HasField("shape"):
                shape = [_read(d, lambda k=k, axis=axis: self.fresh(node, k, axis))
                         for axis, d in enumerate(tensor.shape.dim)]
            self.set(name, tensor.elem_type, shape)

    def type_proto(self, name: str) -> onnx.TypeProto:
        shape = self.shape(name)
        return helper.make_tensor_type_proto(self.elems[name],
                                             None if shape is None else _written(shape))

    def branches(self, node: onnx.NodeProto) -> None:
        """An If: both branches read with the outer graph's facts; an output dim the
        branches agree on is theirs, else a new symbol."""
        named = {a.name: a.g for a in node.attribute}
        branches = [named[b] for b in ("then_branch", "else_branch") if b in named]
        outputs = [self.branch(graph) for graph in branches]
        taken = self.literal(node.input[0])
        if taken is not None and taken.size == 1 and len(outputs) == 2:
            outputs = [outputs[0] if taken.reshape(-1)[0] else outputs[1]]
        for k, name in enumerate(node.output):
            facts = [found[k] for found in outputs if k < len(found)]
            elem = next((e for e, _ in facts if e), None)
            shapes = [s for _, s in facts]
            if not shapes or any(s is None or len(s) != len(shapes[0]) for s in shapes):
                self.set(name, elem, None)
                continue
            merged = []
            for axis, dims in enumerate(zip(*shapes, strict=True)):
                if all(d == dims[0] for d in dims):
                    merged.append(dims[0])
                else:
                    merged.append(self.fresh(node, k, axis))
                    self.branch_dims.add(merged[-1])
            self.set(name, elem, merged)

    def branch(self, graph: onnx.GraphProto) -> list[tuple]:
        """Read a branch in its own scope (two branches may name their values alike, as
        Optimum's merged decoders do), its value_info written; its outputs' facts."""
        saved = [dict(d) for d in (self.shapes, self.elems, self.data, self.floats)]
        self.graph(graph)
        self.write(graph, main=False)
        found = [(self.elems.get(o.name), self.shape(o.name)) for o in graph.output]
        for facts, kept in zip((self.shapes, self.elems, self.data, self.floats), saved,
                               strict=True):
            facts.clear()
            facts.update(kept)
        return found

    # -- writing ----------------------------------------------------------------------
    def value_info(self, name: str) -> onnx.ValueInfoProto | None:
        shape, elem = self.shape(name), self.elems.get(name)
        if shape is None or not elem:
            return None
        return helper.make_tensor_value_info(name, elem, _written(shape))

    def write(self, graph: onnx.GraphProto, main: bool) -> None:
        """``graph``'s value_info (and its outputs' shapes) from the facts (an If's
        branches are written as they are read); a value the file declares and we could
        not read keeps the file's."""
        made = [o for n in graph.node for o in n.output if o]
        outputs = {o.name for o in graph.output}
        had = {v.name: v for v in graph.value_info}
        del graph.value_info[:]
        graph.value_info.extend(v for name in made if name not in outputs
                                if (v := self.value_info(name) or had.get(name)) is not None)
        for output in graph.output:
            found = self.value_info(output.name)
            declared = output.type.tensor_type.HasField("shape")
            if found is not None and not (declared and main and any(
                    s in self.branch_dims for d in self.shape(output.name)
                    for s in d.free_symbols)):  # (a merged decoder's declared outputs)
                output.type.CopyFrom(found.type)


def _read(d: onnx.TensorShapeProto.Dimension, unnamed=lambda: None) -> sympy.Expr | None:
    """A file's dim as an expression; ``unnamed()`` where the file gives it no value or
    name (None unless told)."""
    if d.HasField("dim_value"):
        return sympy.Integer(d.dim_value)
    return parse_dim(d.dim_param) if d.dim_param else unnamed()


def _written(shape: list) -> list[int | str]:
    """Dims as a file holds them: numbers as values, expressions as their text."""
    return [int(d) if d.is_Integer else str(d) for d in shape]


def infer_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with every value whose shape could be read in ``value_info``
    (subgraphs' too), and how many values were left unknown."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inference = Inference(out)
    inference.graph(out.graph)
    inference.write(out.graph, main=True)
    return out, inference.unknown
