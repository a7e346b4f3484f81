"""A sink that scales the attention's output (Granite SWA: softmax(x) @ v * sigmoid(lse(x) -
sink)) rewritten as GPT-OSS's column of the scores, which the recogniser takes onto
GroupQueryAttention's head_sink: the rewrite on its own (same numbers on ONNX Runtime) and
its near misses, which keep the graph as it is."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.optimizer import remove_unused_nodes
from onnxscript.rewriter import RewriteRuleSet

from mha_onnx.rewrite.recognise.attention_sinks import scaled_sink_rules

H = 4
SINK = np.array([0.5, -1.0, 2.0, 0.0], np.float32)


def _graph(*, same_scores: bool = True, sink_input: bool = False, cast: bool = False,
           torchscript: bool = False) -> onnx.ModelProto:
    """scores [B, H, S, T] (+ a second scores input for the near miss), v [B, H, T, D].
    ``torchscript``: as its exporter writes it at opset 17 (the logsumexp's axes an attribute, the
    probabilities cast to themselves twice, the scale first in the Mul)."""
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", f, ["B", H, "S", "T"]),
              helper.make_tensor_value_info("v", f, ["B", H, "T", 8])]
    if not same_scores:
        inputs.append(helper.make_tensor_value_info("x2", f, ["B", H, "S", "T"]))
    if sink_input:
        inputs.append(helper.make_tensor_value_info("sink", f, [1, H, 1]))
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "last")]
    if not sink_input:
        inits.append(numpy_helper.from_array(SINK.reshape(1, H, 1), "sink"))
    shifted = ["shifted"]
    lse_inputs = ["x" if same_scores else "x2"] + ([] if torchscript else ["last"])
    nodes = [helper.make_node("Softmax", ["x"], ["p0" if torchscript else "p"], axis=-1)]
    if torchscript:
        nodes += [helper.make_node("Cast", ["p0"], ["p1"], to=f),
                  helper.make_node("Cast", ["p1"], ["p"], to=f)]
    nodes += [helper.make_node("MatMul", ["p", "v"], ["o"]),
             helper.make_node("ReduceLogSumExp", lse_inputs, ["lse"], keepdims=0,
                              **({"axes": [-1]} if torchscript else {})),
             helper.make_node("Sub", ["lse", "sink"], ["shifted"])]
    if cast:
        nodes.append(helper.make_node("Cast", ["shifted"], ["shifted32"], to=f))
        shifted = ["shifted32"]
    nodes += [helper.make_node("Sigmoid", shifted, ["s"]),
              helper.make_node("Unsqueeze", ["s", "last"], ["scale"])]
    if cast:  # (Granite's float16 export: the scale in float32, cast back)
        nodes.append(helper.make_node("Cast", ["scale"], ["scale16"], to=f))
    scale = "scale16" if cast else "scale"
    nodes.append(helper.make_node("Mul", [scale, "o"] if torchscript else ["o", scale], ["y"]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(
        "y", f, ["B", H, "S", 8])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(
        "", 17 if torchscript else 18)], ir_version=9)


def _rewritten(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    model = ir.from_proto(proto)
    found: list[str] = []
    RewriteRuleSet(scaled_sink_rules(found)).apply_to_model(model)
    remove_unused_nodes(model)  # (as Normalise does: the Softmax and logsumexp replaced)
    return ir.to_proto(model), found


def _run(proto: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(["y"], {k: v for k, v in feeds.items() if k in names})[0]


@pytest.mark.parametrize("cast, torchscript", [(False, False), (True, False), (False, True)],
                         ids=["torch.export", "float16 casts", "torchscript"])
def test_the_scale_becomes_a_column_of_the_scores_with_the_same_numbers(cast, torchscript):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, H, 5, 7)).astype(np.float32) * 3
    x[1, :, :, 4:] = np.finfo(np.float32).min  # masked keys, as the exporters fill them
    feeds = {"x": x, "v": rng.normal(size=(2, H, 7, 8)).astype(np.float32)}
    proto = _graph(cast=cast, torchscript=torchscript)
    rewritten, found = _rewritten(proto)
    assert len(found) == 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert "ReduceLogSumExp" not in ops and "Sigmoid" not in ops and "Concat" in ops
    np.testing.assert_allclose(_run(rewritten, feeds), _run(proto, feeds), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("miss", ["logsumexp of other scores", "sink computed at run time"])
def test_near_misses_are_left_as_they_are(miss):
    proto = _graph(same_scores=miss != "logsumexp of other scores",
                   sink_input=miss == "sink computed at run time")
    rewritten, found = _rewritten(proto)
    assert found == [] and "ReduceLogSumExp" in [n.op_type for n in rewritten.graph.node]
