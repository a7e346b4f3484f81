"""rewrite/prepare/shapes.py: dims read by Shape chains folded where they are static, left where
they are not (a symbolic dim never becomes a number)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from mha_onnx.rewrite.irutil import const_array
from mha_onnx.rewrite.prepare.shapes import fold_static_dims, with_symbolic_shapes
from tests.irgraphs import F, const, model, node, tensor


def _fold(nodes):
    proto = model(nodes, [tensor("x", F, ["B", 4, "S", 16])], ["y"])
    graph = ir.from_proto(proto)
    folded = fold_static_dims(graph)
    (out,) = graph.graph.outputs
    return folded, out


@pytest.mark.parametrize(("picker", "want"), [
    ([node("Constant", [], "a", value_ints=[-1]), node("Constant", [], "b", value_ints=[2 ** 62]),
      node("Slice", ["s", "a", "b"], "p")], [16]),  # GPT-2's Shape(k)[-1:]
    ([node("Constant", [], "i", value_int=1), node("Gather", ["s", "i"], "p")], 4),
], ids=["slice-last", "gather-heads"])
def test_static_dims_read_by_shape_chains_fold(picker, want):
    nodes = [node("Shape", ["x"], "s"), *picker, node("Cast", ["p"], "y", to=1)]
    folded, out = _fold(nodes)
    assert folded == 1
    cast = out.producer()
    np.testing.assert_array_equal(const_array(cast.inputs[0]), np.array(want, np.int64))


@pytest.mark.parametrize("picker", [
    [node("Constant", [], "i", value_int=2), node("Gather", ["s", "i"], "p")],  # S
    [node("Constant", [], "a", value_ints=[0]), node("Constant", [], "b", value_ints=[2]),
     node("Slice", ["s", "a", "b"], "p")],  # [B, 4]: B is symbolic
], ids=["gather-symbolic", "slice-with-a-symbolic-dim"])
def test_symbolic_dims_are_left(picker):
    folded, out = _fold([node("Shape", ["x"], "s"), *picker, node("Cast", ["p"], "y", to=1)])
    assert folded == 0 and out.producer().inputs[0].producer().op_type in ("Gather", "Slice")


def _repeat_interleave() -> list:
    """y = x.repeat_interleave(2, dim=-1) for x [B, S, 8], as the TorchScript exporter
    writes it (Cohere's, GLM's and Helium's interleaved rotary): the repeat count is the max
    of a ConstantOfShape over the repeated dim."""
    return [
        node("Shape", ["x"], "dims", start=0, end=3), node("Shape", ["x"], "last", start=2,
                                                          end=3),
        node("ConstantOfShape", ["last"], "twos",
             value=helper.make_tensor("v", TensorProto.INT64, [1], [2])),
        node("ReduceMax", ["twos"], "count", keepdims=0),
        const("ax0", [0]), node("Unsqueeze", ["count", "ax0"], "count_1d"),
        node("Concat", ["dims", "count_1d"], "target", axis=0),
        const("ax_last", [-1]), node("Unsqueeze", ["x", "ax_last"], "x_1"),
        node("Expand", ["x_1", "target"], "repeated"),
        node("Shape", ["x"], "lead", start=0, end=2), const("minus_one", [-1]),
        node("Concat", ["lead", "minus_one"], "flat", axis=0),
        node("Reshape", ["repeated", "flat"], "y"),
    ]


def test_a_repeat_count_taken_by_reducemax_is_read():
    proto = model(_repeat_interleave(), [tensor("x", F, ["B", "S", 8])], ["y"])
    inferred = with_symbolic_shapes(proto).graph
    found = {v.name: v for v in [*inferred.value_info, *inferred.output]}
    dims = [d.dim_param or d.dim_value for d in found["y"].type.tensor_type.shape.dim]
    assert dims == ["B", "S", 16]


def test_an_operator_nothing_reads_leaves_its_outputs_alone_and_nothing_written(
        tmp_path, monkeypatch):
    """A custom operator's output has no shape; what does not depend on it still has one,
    and inference writes no file where it runs (ORT's infer_shapes saved
    sym_shape_infer_temp.onnx into the working folder when it could not finish)."""
    monkeypatch.chdir(tmp_path)
    proto = model([node("Shape", ["x"], "s"), node("Foo", ["x"], "y", domain="custom.ops"),
                   node("Relu", ["x"], "r")],
                  [tensor("x", F, ["B", 8])], ["y", "s", "r"])
    proto.opset_import.append(helper.make_opsetid("custom.ops", 1))
    outputs = {o.name: o for o in with_symbolic_shapes(proto).graph.output}
    assert not list(tmp_path.iterdir())
    assert not outputs["y"].type.tensor_type.HasField("shape")
    assert [d.dim_value for d in outputs["s"].type.tensor_type.shape.dim] == [2]
    assert [d.dim_param or d.dim_value for d in outputs["r"].type.tensor_type.shape.dim] == [
        "B", 8]


def _viewed_by_own_sizes(whole: bool = False):
    """DeBERTa's attention: heads merged into the batch for bmm ([2B, S, 8]), the scores
    viewed as [B, 2, S, S] for the softmax and back by the probabilities' own sizes,
    ``probs.view(-1, probs.size(-2), probs.size(-1))`` (``whole``: ``probs.size()`` read
    whole and its last two dims taken apart)."""
    pick = [const("lo", [-2]), const("hi", [2 ** 62]),
            node("Slice", ["p_shape", "lo", "hi"], "picked")]
    if whole:
        pick = [node("Cast", ["p_shape"], "p_float", to=TensorProto.FLOAT),
                const("lo", [-2]), const("hi", [2 ** 62]),
                node("Slice", ["p_float", "lo", "hi"], "picked_float"),
                node("Cast", ["picked_float"], "picked", to=TensorProto.INT64)]
    return [
        const("merged", [-1, 0, 8]), node("Reshape", ["q", "merged"], "q3"),
        node("Reshape", ["k", "merged"], "k3"), node("Reshape", ["v", "merged"], "v3"),
        node("Transpose", ["k3"], "kt", perm=[0, 2, 1]),
        node("MatMul", ["q3", "kt"], "qk"), const("scale", 8 ** -0.5),
        node("Mul", ["qk", "scale"], "scores3"),
        node("Shape", ["scores3"], "st", start=1, end=3), const("bh", [-1, 2]),
        node("Concat", ["bh", "st"], "split", axis=0),
        node("Reshape", ["scores3", "split"], "scores"),
        node("Softmax", ["scores"], "probs", axis=-1),
        node("Shape", ["probs"], "p_shape"), *pick, const("lead", [-1]),
        node("Concat", ["lead", "picked"], "target", axis=0),
        node("Reshape", ["probs", "target"], "viewed"),
        node("MatMul", ["viewed", "v3"], "y"),
    ]


@pytest.mark.parametrize("whole", [False, True], ids=["dims picked", "shape read whole"])
def test_probabilities_viewed_by_their_own_sizes_are_fused(whole, tmp_path):
    """Their dims read from an input instead (the length from q, the heads a constant):
    nothing reads the probabilities but the block, so the block fuses, and verifies."""
    import onnx

    from mha_onnx.rewrite import fuse_file

    inputs = [tensor(n, F, ["B", "S", 16]) for n in ("q", "k", "v")]
    onnx.save(model(_viewed_by_own_sizes(whole), inputs, ["y"],
                    out_types={"y": (F, [None, "S", 8])}), tmp_path / "m.onnx")
    report = fuse_file(tmp_path / "m.onnx", tmp_path / "fused.onnx")
    assert [r.status for r in report.blocks] == ["fused"], [r.reason for r in report.blocks]
    assert report.verification is not None and report.verification.passed


def test_a_dim_no_input_has_is_not_read_elsewhere():
    """probability_shapes moves a read only where every dim it reads has a source: a dim
    the inputs do not carry (``X``) leaves the read as it is."""
    from mha_onnx.rewrite.prepare.shapes import probability_shapes

    proto = model([node("Softmax", ["x"], "probs", axis=-1), node("Shape", ["probs"], "s"),
                   const("i", [1]), node("Gather", ["s", "i"], "d"),
                   node("Cast", ["d"], "y", to=TensorProto.FLOAT)],
                  [tensor("x", F, ["B", "S"])], ["y"])
    graph = ir.from_proto(proto)
    probs = next(n for n in graph.graph if n.op_type == "Softmax").outputs[0]
    probs.shape = ir.Shape(["B", "X"])
    assert probability_shapes(graph) == 0
    probs.shape = ir.Shape(["B", "S"])
    assert probability_shapes(graph) == 1


def test_the_projection_is_found_through_reshapes_to_and_from_merged_heads():
    """DeBERTa splits the heads ([B, S, H*D] -> [B, S, H, D] -> [B, H, S, D]), merges them into
    the batch for bmm ([B*H, S, D]), and the fusion views that as [B, H, S, D] again: the
    kernel reads the projection [B, S, H*D] itself, not a transpose of the round trip."""
    from mha_onnx.rewrite.sdpa import bsd_source

    tape = ir.tape.Tape()
    x3 = ir.Value(name="x3", shape=ir.Shape(["B", "S", 16]), type=ir.TensorType(ir.DataType.FLOAT))

    def reshaped(value, dims_out, target):
        out = tape.op("Reshape", [value, tape.op("Constant", [], {"value": ir.tensor(
            np.array(target, np.int64))})])
        out.shape = ir.Shape(dims_out)
        return out

    split = reshaped(x3, ["B", "S", 2, 8], [0, 0, 2, 8])
    heads = tape.op("Transpose", [split], {"perm": [0, 2, 1, 3]})
    heads.shape = ir.Shape(["B", 2, "S", 8])
    merged = reshaped(heads, ["2*B", "S", 8], [-1, 0, 8])
    viewed = reshaped(merged, [None, 2, "S", 8], [-1, 2, 0, 8])
    assert bsd_source(viewed, 2) is x3
    other = reshaped(merged, [None, 2, "T", 8], [-1, 2, 0, 8])  # not the same dims: kept
    assert bsd_source(other, 2) is None


def test_a_reduce_max_with_axes_as_input_keeps_the_inference_going():
    """GPT-OSS's ``logits - logits.max(-1, keepdim=True)`` at opset 18 (axes an input): ONNX
    gave the ReduceMax no shape and ORT's symbolic inference then stopped at the Sub, leaving
    the whole graph without shapes (its attention blocks unreadable)."""
    from onnx import TensorProto, helper

    from mha_onnx.rewrite.prepare.shapes import with_symbolic_shapes

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, "s", "t"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Constant", [], ["axes"], value=helper.make_tensor(
                 "a", TensorProto.INT64, [1], [-1])),
             helper.make_node("ReduceMax", ["x", "axes"], ["m"], keepdims=1),
             helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Softmax", ["d"], ["y"], axis=-1)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in with_symbolic_shapes(model).graph.value_info}
    assert shapes["m"] == ["b", 4, "s", 1]
    assert shapes["d"] == ["b", 4, "s", "t"]


@pytest.mark.parametrize(("source", "kept"), [("m", False), ("x", True)])
def test_a_slice_to_a_length_nothing_compares_gets_its_own_dim(source, kept):
    """x[:, :m.shape[1]]: ORT's inference "treats as equal" an end it cannot compare with the
    dim, so a cut looked uncut (Moonshine's mask cut to its conv stack's length, which the
    optimizer then dropped as a no-op Slice). Here the axis gets a dim of its own; cut to
    x's own length, it keeps x's."""
    nodes = [node("Shape", [source], "s"), const("one", [1]), const("two", [2]),
             node("Slice", ["s", "one", "two"], "end"), const("zero", [0]),
             node("Slice", ["x", "zero", "end", "one"], "y")]
    proto = model(nodes, [tensor("x", F, ["B", "N"]), tensor("m", F, ["B", "M"])], ["y"])
    inferred = {v.name: v for v in with_symbolic_shapes(proto).graph.output}
    got = [d.dim_param or d.dim_value for d in inferred["y"].type.tensor_type.shape.dim]
    assert got[0] == "B", got
    assert got[1] == "N" if kept else (isinstance(got[1], str) and got[1] not in ("N", "M")), got


@pytest.mark.parametrize(("end", "want"), [
    ([node("Shape", ["m"], "ms"), const("i0", [0]), node("Gather", ["ms", "i0"], "end")],
     None),  # M: no relation to N, a new symbol
    ([node("Shape", ["x"], "xs"), const("i1", [1]), node("Gather", ["xs", "i1"], "n"),
      const("two", [2]), node("Sub", ["n", "two"], "end")], "N - 2"),  # within N
    ([node("Shape", ["x"], "xs"), const("i1", [1]), node("Gather", ["xs", "i1"], "n"),
      const("two", [2]), node("Add", ["n", "two"], "end")], "N"),  # past N: all of it
], ids=["unrelated", "inside", "past-the-end"])
def test_a_slice_end_that_cannot_be_placed_gets_a_new_dim_and_inference_goes_on(end, want):
    """An end whose place on the dim is not decided (SEW's squeezed length, another input's
    length) gives the sliced axis a symbol of its own, never the dim it was cut from (ORT
    "treats them as equal", and asserted on some); the rest of the graph is still read."""
    nodes = [*end, const("zero", [0]), const("one", [1]),
             node("Slice", ["x", "zero", "end", "one"], "cut"), node("Relu", ["cut"], "y")]
    proto = model(nodes, [tensor("x", F, ["B", "N", 8]), tensor("m", F, ["M"])], ["y"])
    inferred = {v.name: v for v in with_symbolic_shapes(proto).graph.output}
    got = [d.dim_param or d.dim_value for d in inferred["y"].type.tensor_type.shape.dim]
    assert got[0] == "B" and got[2] == 8, got
    assert got[1] == want if want else got[1] not in ("N", "M", 0, 2), got


def test_a_shape_sliced_at_a_constant_mod_is_read():
    """nn.MultiheadAttention's packed K/V in-projection (SigLIP's pooling head) reshapes to
    ``shape[:Mod(-1, 3)] + [2, E] + shape[Mod(-1, 3) + 1:]``: ORT's inference carries no value
    through Mod, asserted at the Reshape (a shape of unknown length) and left the whole graph
    without shapes. The graph given back is the original, Mod and all."""
    x = tensor("x", F, ["s", "b", 6])
    nodes = [node("Shape", ["x"], "shape"), const("minus", [-1]), const("rank", [3]),
             node("Mod", ["minus", "rank"], "axis"), const("zero", [0]), const("one", [1]),
             node("Slice", ["shape", "zero", "axis"], "head"),
             node("Add", ["axis", "one"], "after"), const("big", [2 ** 62]),
             node("Slice", ["shape", "after", "big"], "tail"), const("split", [2, 3]),
             node("Concat", ["head", "split", "tail"], "target", axis=0),
             node("Reshape", ["x", "target"], "y")]
    proto = model(nodes, [x], ["y"])
    inferred = with_symbolic_shapes(proto)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*inferred.graph.value_info, *inferred.graph.output]}
    assert shapes["y"] == ["s", "b", 2, 3]
    assert [n.op_type for n in inferred.graph.node] == [n.op_type for n in proto.graph.node]
