"""Small integer arithmetic on constants alone, computed: what ORT's symbolic shape
inference (shapes.py) needs to see as values and cannot compute itself."""

from __future__ import annotations

import onnx

_FOLDABLE = {"Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Cast", "Reshape", "Squeeze",
             "Unsqueeze", "Concat", "Gather", "Slice", "Range", "Min", "Max", "Equal", "Where"}


def constants_folded(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy in which small integer arithmetic on constants alone is a
    Constant: ORT's inference carries no value through ``Mod`` (nn.MultiheadAttention's packed
    in-projection slices its shape vector at ``Mod(-1, 3)``, SigLIP's pooling head: a shape
    vector of unknown length stopped the whole inference at its Reshape)."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    values = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    values.update((t.name, numpy_helper.to_array(t)) for t in model.graph.initializer
                  if t.data_type == onnx.TensorProto.INT64 and len(t.dims) <= 1)
    nodes, folded = list(model.graph.node), 0
    for i, node in enumerate(nodes):
        if (node.op_type not in _FOLDABLE or node.domain not in ("", "ai.onnx")
                or len(node.output) != 1 or not all(x in values for x in node.input if x)
                or not all(values[x].size <= 64 for x in node.input if x)):
            continue
        try:
            result = ReferenceEvaluator(node).run(
                None, {x: values[x] for x in node.input if x})[0]
        except Exception:  # noqa: BLE001 - left to the inference as it is
            continue
        if result.dtype.kind not in "iu" or result.size > 64:
            continue
        values[node.output[0]] = result
        nodes[i] = onnx.helper.make_node("Constant", [], list(node.output),
                                         value=numpy_helper.from_array(result))
        folded += 1
    if not folded:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return copy
