"""graph/symbolic: our symbolic shape inference. Dims named through shape arithmetic,
symbols merged where broadcasting says they are equal, If branches read in place (the taken
one where the condition is known), conv lengths, and what it leaves unknown."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.graph.symbolic import infer_shapes
from mha_onnx.graph.symbolic.facts import parse_dim
from tests.irgraphs import F, const, model, node, tensor


def _shapes(proto: onnx.ModelProto) -> dict[str, list]:
    inferred, _ = infer_shapes(proto)
    graphs = [inferred.graph] + [a.g for n in inferred.graph.node for a in n.attribute
                                 if a.type == onnx.AttributeProto.GRAPH]
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for g in graphs for v in [*g.value_info, *g.output]
            if v.type.tensor_type.HasField("shape")}


def test_a_reshape_target_made_from_shape_arithmetic_names_its_dims():
    """TorchScript's ``x.view(b, s, heads, -1)`` with the sizes read from x: the dims are
    the input's symbols, the -1 the arithmetic that gives it."""
    nodes = [node("Shape", ["x"], "s"), const("i0", [0, 1]), node("Gather", ["s", "i0"], "bs"),
             const("tail", [2, -1]), node("Concat", ["bs", "tail"], "target", axis=0),
             node("Reshape", ["x", "target"], "y"),
             node("Transpose", ["y"], "t", perm=[0, 2, 1, 3])]
    shapes = _shapes(model(nodes, [tensor("x", F, ["B", "S", 16])], ["t"]))
    assert shapes["y"] == ["B", "S", 2, 8]
    assert shapes["t"] == ["B", 2, "S", 8]


def test_a_length_computed_from_two_inputs_is_their_sum():
    """A cache's total length: past + new, written as the expression fuse reads."""
    nodes = [node("Concat", ["past", "new"], "k", axis=2)]
    shapes = _shapes(model(nodes, [tensor("past", F, ["B", 2, "P", 8]),
                                   tensor("new", F, ["B", 2, "S", 8])], ["k"]))
    assert parse_dim(shapes["k"][2]) == parse_dim("P + S")


def test_broadcasting_merges_a_derived_symbol_never_an_inputs():
    """A Range's length (a symbol of its own) broadcast against an input's axis is that
    axis everywhere after; two inputs' symbols broadcast are both kept."""
    nodes = [const("zero", 0), node("Shape", ["n"], "ns"), const("i0", 0),
             node("Gather", ["ns", "i0"], "count"), const("one", 1),
             node("Range", ["zero", "count", "one"], "r"),
             node("Cast", ["r"], "rf", to=TensorProto.FLOAT),
             node("Add", ["x", "rf"], "y"), node("Add", ["x", "m"], "z")]
    shapes = _shapes(model(nodes, [tensor("x", F, ["B", "S"]), tensor("n", F, ["N"]),
                                   tensor("m", F, ["B", "T"])], ["y", "z", "rf"]))
    assert shapes["rf"] == ["N"]  # Range(0, N, 1)
    assert shapes["y"] == ["B", "S"]
    assert shapes["z"][0] == "B" and shapes["z"][1] in ("S", "T")


def test_torchscripts_expand_reads_its_minus_one_test():
    """``expand`` as TorchScript writes it: Where(Equal(shape, -1), ones, shape); a size
    is never -1, so the target is the shape itself."""
    nodes = [node("Shape", ["x"], "s"), const("minus", [-1, -1]),
             node("Equal", ["s", "minus"], "is_minus"), const("ones", [1, 1]),
             node("Where", ["is_minus", "ones", "s"], "target"),
             node("Expand", ["v", "target"], "y")]
    shapes = _shapes(model(nodes, [tensor("x", F, ["B", "S"]), tensor("v", F, [1, 1])], ["y"]))
    assert shapes["y"] == ["B", "S"]


def _if(condition: list, then_shape: list, else_shape: list) -> onnx.ModelProto:
    def branch(name: str, dims: list) -> onnx.GraphProto:
        target = helper.make_node("Constant", [], [f"{name}_t"],
                                  value=numpy_helper.from_array(np.array(dims, np.int64)))
        reshape = helper.make_node("Reshape", ["x", f"{name}_t"], [f"{name}_y"])
        return helper.make_graph([target, reshape], name, [],
                                 [onnx.ValueInfoProto(name=f"{name}_y")])

    cond = [*condition, helper.make_node("If", ["c"], ["y"],
                                         then_branch=branch("then", then_shape),
                                         else_branch=branch("else", else_shape))]
    return model(cond, [tensor("x", F, [2, 3, 4]), tensor("flag", TensorProto.BOOL, [])],
                 ["y"])


@pytest.mark.parametrize(("condition", "want"), [
    ([node("Shape", ["x"], "s"), const("i", [0]), node("Gather", ["s", "i"], "d"),
      const("two", [2]), node("Equal", ["d", "two"], "c")], [6, 4]),  # known: then
    ([node("Identity", ["flag"], "c")], None),  # not known: the branches differ in rank
], ids=["known-condition", "run-time-condition"])
def test_an_ifs_output_is_the_taken_branchs_when_the_condition_is_known(condition, want):
    shapes = _shapes(_if(condition, [6, 4], [24]))
    assert shapes.get("y") == want
    assert shapes["then_y"] == [6, 4] and shapes["else_y"] == [24]  # branches read in place


def test_branches_that_agree_on_a_dim_keep_it_and_differ_on_another_get_a_new_one():
    shapes = _shapes(_if([node("Identity", ["flag"], "c")], [2, 12], [2, 3, 4][:1] + [12]))
    assert shapes["y"] == [2, 12]
    shapes = _shapes(_if([node("Identity", ["flag"], "c")], [2, 12], [4, 6]))
    assert len(shapes["y"]) == 2 and all(isinstance(d, str) for d in shapes["y"])


def test_a_convolutions_length_is_arithmetic_on_its_input():
    """A speech front end (kernel 3, stride 2, pad 1): each length is read, so the
    attention after it has named dims rather than unknown ones."""
    weight = helper.make_tensor("w", F, [4, 1, 3], np.zeros(12, np.float32))
    nodes = [node("Conv", ["x", "w"], "y", strides=[2], pads=[1, 1])]
    proto = model(nodes, [tensor("x", F, ["B", 1, "L"])], ["y"])
    proto.graph.initializer.append(weight)
    got = _shapes(proto)["y"]
    assert got[:2] == ["B", 4]
    length = parse_dim(got[2])
    (symbol,) = length.free_symbols
    for n in (1, 2, 7, 16):  # the expression is the conv's formula at every length
        assert length.subs(symbol, n) == (n + 2 - 3) // 2 + 1


def test_unknown_operators_leave_their_outputs_alone_and_count_them():
    proto = model([node("Foo", ["x"], "y", domain="custom"), node("Relu", ["y"], "z"),
                   node("Relu", ["x"], "r")], [tensor("x", F, ["B", 8])], ["z", "r"])
    proto.opset_import.append(helper.make_opsetid("custom", 1))
    inferred, unknown = infer_shapes(proto)
    assert unknown == 2  # y, and z after it
    assert _shapes(proto) == {"r": ["B", 8]}
    assert inferred.graph.node == proto.graph.node  # the graph itself untouched
    proto.graph.value_info.append(helper.make_tensor_value_info("y", F, ["B", 3]))
    assert _shapes(proto)["y"] == ["B", 3]  # what the file says of it is kept


@pytest.mark.parametrize("name", [
    "llama/model.onnx",  # a KV cache: past + new
    "moonshine/encoder_model.onnx",  # raw audio through a conv stack, a strided mask
    "swin/model.onnx",  # padded, shifted windows
    "deberta_v2/model.onnx",  # an If whose condition is known
    "wav2vec2/model.onnx",  # a conv front end and a feature projection
    "bart/decoder_model.onnx",  # self- and cross-attention: two lengths
])
def test_every_inferred_dim_is_what_onnx_runtime_gives_when_the_file_runs(name):
    """Optimum's files (nobody here wrote them) run in ORT at odd sizes with every value of
    the main graph an output: each dim we wrote in the inputs' terms evaluates, at those
    sizes, to the size ORT gave (a symbol of our own making has no value and is skipped)."""
    import onnxruntime as ort

    from mha_onnx.graph.dims import with_related_dims
    from mha_onnx.graph.expressions import evaluate
    from mha_onnx.graph.inputs import case_for, input_specs, make_inputs
    from tests.paths import OPTIMUM

    proto = onnx.load(OPTIMUM / name)
    specs = input_specs(proto)
    proto = with_related_dims(proto, specs)
    inferred, _ = infer_shapes(proto)
    outputs = {o.name for o in proto.graph.output}
    wrote = {v.name: v for v in inferred.graph.value_info if v.name not in outputs}
    case = case_for(specs, "odd", 2, [13, 7, 19, 5])
    sizes = dict(case.dims)  # and the file's own names of dims the specs fix (Swin's 32x32)
    for spec, value in zip(specs, proto.graph.input, strict=False):
        for want, d in zip(spec.dims, value.type.tensor_type.shape.dim, strict=False):
            if isinstance(want, int) and d.dim_param:
                sizes[d.dim_param] = want
    exposed = onnx.ModelProto()
    exposed.CopyFrom(proto)
    exposed.graph.output.extend(helper.make_tensor_value_info(n, v.type.tensor_type.elem_type,
                                                              None) for n, v in wrote.items())
    session = ort.InferenceSession(exposed.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    got = session.run(list(wrote), make_inputs(specs, case))
    symbolic, ours = 0, 0
    for (value_name, info), array in zip(wrote.items(), got, strict=True):
        dims = info.type.tensor_type.shape.dim
        assert len(dims) == array.ndim, (value_name, dims, array.shape)
        for d, size in zip(dims, array.shape, strict=True):
            want = d.dim_value if d.HasField("dim_value") else evaluate(d.dim_param, sizes)
            symbolic += d.HasField("dim_param")
            ours += want is None
            assert want in (None, size), (value_name, d, array.shape, sizes)
    assert ours <= 0.05 * symbolic, (ours, symbolic)  # nearly all in the inputs' terms
