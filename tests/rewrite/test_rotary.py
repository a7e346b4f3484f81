"""rotary.fold_rotary on a small graph spelt as Hugging Face's rotation exports: Q and K
rotated inside GroupQueryAttention where a run's positions allow it, the exporter's rotation
otherwise, and nothing folded where cos/sin are not a lookup by one positions input."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from mha_onnx.graph.walk import all_nodes
from mha_onnx.rewrite.forms import COUNTED, NO_PAST, ONE_TOKEN, either, rotating_kernels
from mha_onnx.rewrite.irutil import MS_DOMAIN
from mha_onnx.rewrite.tighten.into_branches import sink_into_branches
from mha_onnx.rewrite.tighten.norms import fuse_norms
from mha_onnx.rewrite.tighten.rotary_fold import fold_rotary
from mha_onnx.runtime.ort import OrtRunner

N, G, D = 4, 2, 16  # query heads, K/V heads, head size


def _const(name: str, values, dtype=np.int64) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), np.shape(values),
        np.asarray(values, dtype).reshape(-1).tolist()))


def _rotation(x: str, heads: int, nodes: list, norm: bool = False, rotary: int = 0,
              interleaved: bool = False, before: bool = False, sliced: bool = False,
              tables: tuple[str, str] = ("cos4", "sin4")) -> str:
    """x [B, S, heads*D] -> heads split, (``norm``: each head RMS-normalised over D, Qwen3's
    q_norm spelt as Hugging Face's RMSNorm exports) rotated (x * cos + rotate_half(x) * sin;
    ``rotary``: only each head's first ``rotary`` dims, the rest passed as they are, GPT-NeoX's
    and Phi's partial rotary; ``interleaved``: pairs (x0, x1), (x2, x3), ... rotated,
    stack(-x[..., 1::2], x[..., 0::2]) flattened, as Cohere and Helium export it), joined
    again as our lowering feeds GroupQueryAttention; returns the joined name. ``before``: the
    rotation on [B, S, heads, D], before the heads' transpose (GPT-J, CodeGen; ``tables``
    then [B, S, 1, D]); ``sliced``: the heads sliced out of a wider tensor of each head's
    values twice over (GPT-NeoX's heads out of its fused QKV), not a plain split."""
    nodes += [
        _const(f"{x}_shape", [0, 0, heads, D]),
        helper.make_node("Reshape", [x, f"{x}_shape"], [f"{x}_4"]),
    ]
    split = f"{x}_4"
    if sliced:
        nodes.append(helper.make_node("Concat", [split, split], [f"{x}_wide"], axis=-1))
        split = f"{x}_wide"
    if norm:
        weight = np.linspace(0.5, 1.5, D)
        nodes += [
            _const(f"{x}_two", 2.0, np.float32), _const(f"{x}_eps", 1e-6, np.float32),
            _const(f"{x}_axes", [-1]), _const(f"{x}_w", weight, np.float32),
            helper.make_node("Pow", [split, f"{x}_two"], [f"{x}_sq"]),
            helper.make_node("ReduceMean", [f"{x}_sq", f"{x}_axes"], [f"{x}_ms"]),
            helper.make_node("Add", [f"{x}_ms", f"{x}_eps"], [f"{x}_mse"]),
            helper.make_node("Sqrt", [f"{x}_mse"], [f"{x}_rms"]),
            helper.make_node("Reciprocal", [f"{x}_rms"], [f"{x}_inv"]),
            helper.make_node("Mul", [split, f"{x}_inv"], [f"{x}_unit"]),
            helper.make_node("Mul", [f"{x}_w", f"{x}_unit"], [f"{x}_normed"]),
        ]
        split = f"{x}_normed"
    heads_in = split
    if not before:
        nodes.append(helper.make_node("Transpose", [split], [f"{x}_h"], perm=[0, 2, 1, 3]))
        heads_in = f"{x}_h"
    if sliced:
        nodes += [_const(f"{x}_w0", [0]), _const(f"{x}_wd", [D]), _const(f"{x}_wax", [-1]),
                  helper.make_node("Slice", [heads_in, f"{x}_w0", f"{x}_wd", f"{x}_wax"],
                                   [f"{x}_hs"])]
        heads_in = f"{x}_hs"
    if rotary:
        nodes += [
            _const(f"{x}_p0", [0]), _const(f"{x}_pr", [rotary]), _const(f"{x}_pend", [2**62]),
            _const(f"{x}_pax", [-1]),
            helper.make_node("Slice", [heads_in, f"{x}_p0", f"{x}_pr", f"{x}_pax"], [f"{x}_hr"]),
            helper.make_node("Slice", [heads_in, f"{x}_pr", f"{x}_pend", f"{x}_pax"],
                             [f"{x}_pass"]),
        ]
        heads_in = f"{x}_hr"
    width = rotary or D
    if interleaved:
        nodes += [
            _const(f"{x}_lo", [0]), _const(f"{x}_odd", [1]), _const(f"{x}_hi", [2**62]),
            _const(f"{x}_ax", [-1]), _const(f"{x}_two", [2]), _const(f"{x}_flat", [0, 0, 0, -1]),
            helper.make_node("Slice", [heads_in, f"{x}_lo", f"{x}_hi", f"{x}_ax", f"{x}_two"],
                             [f"{x}_a"]),
            helper.make_node("Slice", [heads_in, f"{x}_odd", f"{x}_hi", f"{x}_ax", f"{x}_two"],
                             [f"{x}_b"]),
            helper.make_node("Neg", [f"{x}_b"], [f"{x}_nb"]),
            helper.make_node("Unsqueeze", [f"{x}_nb", f"{x}_ax"], [f"{x}_nb5"]),
            helper.make_node("Unsqueeze", [f"{x}_a", f"{x}_ax"], [f"{x}_a5"]),
            helper.make_node("Concat", [f"{x}_nb5", f"{x}_a5"], [f"{x}_st"], axis=-1),
            helper.make_node("Reshape", [f"{x}_st", f"{x}_flat"], [f"{x}_rh"]),
        ]
    else:
        nodes += [
            _const(f"{x}_lo", [0]), _const(f"{x}_mid", [width // 2]), _const(f"{x}_hi", [2**62]),
            _const(f"{x}_ax", [-1]),
            helper.make_node("Slice", [heads_in, f"{x}_lo", f"{x}_mid", f"{x}_ax"], [f"{x}_a"]),
            helper.make_node("Slice", [heads_in, f"{x}_mid", f"{x}_hi", f"{x}_ax"], [f"{x}_b"]),
            helper.make_node("Neg", [f"{x}_b"], [f"{x}_nb"]),
            helper.make_node("Concat", [f"{x}_nb", f"{x}_a"], [f"{x}_rh"], axis=-1),
        ]
    nodes += [
        helper.make_node("Mul", [heads_in, tables[0]], [f"{x}_c"]),
        helper.make_node("Mul", [f"{x}_rh", tables[1]], [f"{x}_s"]),
        helper.make_node("Add", [f"{x}_c", f"{x}_s"], [f"{x}_rr" if rotary else f"{x}_r"]),
    ]
    if rotary:
        nodes.append(helper.make_node("Concat", [f"{x}_rr", f"{x}_pass"], [f"{x}_r"], axis=-1))
    if before:  # the exporter's transpose of the rotated heads, then our lowering's join
        nodes[-1].output[0] = f"{x}_rb"
        nodes.append(helper.make_node("Transpose", [f"{x}_rb"], [f"{x}_r"], perm=[0, 2, 1, 3]))
    nodes += [
        helper.make_node("Transpose", [f"{x}_r"], [f"{x}_t"], perm=[0, 2, 1, 3]),
        _const(f"{x}_join", [0, 0, -1]),
        helper.make_node("Reshape", [f"{x}_t", f"{x}_join"], [f"{x}_3"]),
    ]
    return f"{x}_3"


def _model(offset_input: bool = False, past: bool = False, norm: bool = False,
           rotary: int = 0, interleaved: bool = False, before: bool = False,
           sliced: bool = False, lookup: int = 0) -> onnx.ModelProto:
    """q [B, S, N*D], k/v [B, S, G*D], position_ids [B, S] -> GroupQueryAttention (no past)
    of the rotated Q and K. ``offset_input``: cos/sin also read a second input (not a
    lookup by the positions alone). ``past``: with past_key/past_value [B, G, P, D].
    ``norm``: Q's and K's heads RMS-normalised before the rotation (Qwen3). ``rotary``: a
    partial rotary of each head's first ``rotary`` dims. ``interleaved``: the pairs' layout,
    cos/sin holding each frequency twice in a row (repeat_interleave). ``before`` and
    ``sliced``: see _rotation (``before``: cos/sin [B, S, 1, D], computed once for Q and
    once for K, as GPT-J does). ``lookup``: cos/sin gathered by position from a table of
    that many rows (GPT-J's embed_positions), not computed from the positions."""
    width = rotary or D
    inv_freq = (1.0 / 10000 ** (np.arange(0, width, 2) / width)).astype(np.float32).reshape(
        1, -1, 1)
    nodes = [
        helper.make_node("Constant", [], ["inv_freq"], value=helper.make_tensor(
            "inv_freq", TensorProto.FLOAT, inv_freq.shape, inv_freq.reshape(-1).tolist())),
        _const("one", [1]),
        helper.make_node("Unsqueeze", ["position_ids", "one"], ["pos3"]),
        helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
    ]
    positions = "posf"
    if offset_input:
        nodes.append(helper.make_node("Add", ["posf", "offset"], ["posf2"]))
        positions = "posf2"
    nodes += [
        helper.make_node("MatMul", ["inv_freq", positions], ["freqs"]),
        helper.make_node("Transpose", ["freqs"], ["freqs_t"], perm=[0, 2, 1]),
        *([_const("pair_axis", [-1]), _const("flat3", [0, 0, -1]),
           helper.make_node("Unsqueeze", ["freqs_t", "pair_axis"], ["freqs_4"]),
           helper.make_node("Concat", ["freqs_4", "freqs_4"], ["freqs_pairs"], axis=-1),
           helper.make_node("Reshape", ["freqs_pairs", "flat3"], ["emb"])] if interleaved else
          [helper.make_node("Concat", ["freqs_t", "freqs_t"], ["emb"], axis=-1)]),
    ]
    if lookup:  # the same values, stored for positions 0 .. lookup - 1 and gathered
        del nodes[2:]
        angles = np.arange(lookup, dtype=np.float32)[:, None] * inv_freq.reshape(1, -1)
        angles = np.repeat(angles, 2, axis=1) if interleaved else np.concatenate(
            [angles, angles], axis=1)
        for name in ("cos", "sin"):
            table = getattr(np, name)(angles).astype(np.float32)
            nodes += [helper.make_node("Constant", [], [f"{name}_table"],
                                       value=helper.make_tensor(f"{name}_table",
                                                                TensorProto.FLOAT, table.shape,
                                                                table.reshape(-1).tolist())),
                      helper.make_node("Gather", [f"{name}_table", "position_ids"], [name])]
    else:
        nodes += [helper.make_node("Cos", ["emb"], ["cos"]),
                  helper.make_node("Sin", ["emb"], ["sin"])]
    nodes.append(_const("two", [2]))
    for x in ("q", "k") if before else ("q",):  # (GPT-J unsqueezes cos/sin for Q and K each)
        nodes += [helper.make_node("Unsqueeze", [name, "two" if before else "one"],
                                   [f"{name}4{x}"]) for name in ("cos", "sin")]
    q3 = _rotation("q", N, nodes, norm, rotary, interleaved, before, sliced, ("cos4q", "sin4q"))
    k3 = _rotation("k", G, nodes, norm, rotary, interleaved, before, sliced,
                   ("cos4k" if before else "cos4q", "sin4k" if before else "sin4q"))
    nodes += [
        helper.make_node("Shape", ["k"], ["knew"], start=1, end=2),
        helper.make_node("Shape", ["past_key" if past else "k"], ["kpast"], start=2 if past else 1,
                         end=3 if past else 1),
        helper.make_node("ReduceSum", ["kpast"], ["kpast1"], keepdims=1),
        helper.make_node("Add", ["knew", "kpast1"], ["kshape"]),
        helper.make_node("Cast", ["kshape"], ["total1"], to=TensorProto.INT32),
        _const("scalar", [], np.int64),
        helper.make_node("Reshape", ["total1", "scalar"], ["total"]),
        _const("one32", 1, np.int32),
        helper.make_node("Sub", ["total", "one32"], ["last"]),
        helper.make_node("Shape", ["k"], ["batch"], start=0, end=1),
        helper.make_node("Expand", ["last", "batch"], ["seqlens"]),
        helper.make_node("GroupQueryAttention", [q3, k3, "v", "past_key" if past else "",
                                                 "past_value" if past else "", "seqlens", "total"],
                         ["out", "present_key", "present_value"], domain=MS_DOMAIN,
                         num_heads=N, kv_num_heads=G),
    ]
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", "S", N * D]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, ["B", "S", G * D]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, ["B", "S", G * D]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "S"])]
    if offset_input:
        inputs.append(helper.make_tensor_value_info("offset", TensorProto.FLOAT, []))
    if past:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", G, "P", D])
                   for n in ("past_key", "past_value")]
    graph = helper.make_graph(nodes, "rotated", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


def _folded(proto: onnx.ModelProto, rows: int = 64):
    model = ir.from_proto(proto)
    fuse_norms(model)  # (as rewrite/passes.py runs them: the norms first)
    folded = fold_rotary(model, max_positions=rows)
    sink_into_branches(model.graph, folded.copyable(model.graph))
    return folded, ir.to_proto(model)


def _feeds(batch: int, seq: int, positions: np.ndarray, rng) -> dict[str, np.ndarray]:
    return {"q": rng.standard_normal((batch, seq, N * D)).astype(np.float32),
            "k": rng.standard_normal((batch, seq, G * D)).astype(np.float32),
            "v": rng.standard_normal((batch, seq, G * D)).astype(np.float32),
            "position_ids": positions.astype(np.int64)}


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.op_type != "Constant"]


def _same_outputs(original: onnx.ModelProto, model: onnx.ModelProto,
                  feeds: dict[str, np.ndarray], atol: float = 5e-6) -> None:
    want = OrtRunner(original.SerializeToString(), "cpu").infer(feeds)
    got = OrtRunner(model.SerializeToString(), "cpu").infer(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=atol, err_msg=name)


THREE_RUNS = pytest.mark.parametrize("positions", [
    np.array([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]),  # counted up: the kernel rotates
    np.array([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]]),  # not: RotaryEmbedding, then the kernel
    np.array([[3], [11]]),  # one token per row: the kernel
], ids=["counted", "left-padded", "one-token"])


def test_the_rotation_moves_into_the_kernel_behind_a_guard():
    folded, model = _folded(_model())
    assert list(folded.blocks.values()) == ["position_ids"]
    nodes = list(all_nodes(model.graph))
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    rotating = [n for n in gqa if any(a.name == "do_rotary" and a.i == 1 for a in n.attribute)]
    ropes = {o: n for n in nodes if n.op_type == "RotaryEmbedding" for o in n.output}
    # rotating itself | reading RotaryEmbedding's Q and K | as exported
    assert len(gqa) == 3 and len(rotating) == 1
    assert list(rotating[0].input[:3]) == ["q", "k", "v"]  # the projections, not rotated
    roped = [n for n in gqa if n.input[0] in ropes and n.input[1] in ropes]
    assert len(roped) == 1 and [ropes[i].input[0] for i in roped[0].input[:2]] == ["q", "k"]
    assert "Neg" not in _ops(model) and "Cos" not in _ops(model)  # moved into the branch


@pytest.mark.parametrize("positions, kernel", [
    (np.array([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]), False),
    (np.array([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]]), True),
], ids=["counted", "left-padded"])
def test_a_left_padded_prompt_is_rotated_by_rotary_embedding(tmp_path, positions, kernel):
    """The kernel counts a prompt's positions up from the first row's first: a left-padded
    prompt runs RotaryEmbedding over the same tables, each token at its own position, not
    the exporter's dozen ops (ORT's profiler says which ran)."""
    from mha_onnx.runtime.ort import read_profile

    original = _model()
    _, model = _folded(original)
    feeds = _feeds(*positions.shape, positions, np.random.default_rng(0))
    _same_outputs(original, model, feeds)
    runner = OrtRunner(model.SerializeToString(), "cpu", profile_dir=str(tmp_path))
    runner.infer(feeds)
    ran = {e.op_type for e in read_profile(runner.end_profiling())}
    assert ("RotaryEmbedding" in ran) == kernel and "Neg" not in ran


@pytest.mark.parametrize("positions", [
    np.array([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]),  # a prompt counted up: the kernel rotates
    np.array([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]]),  # a left-padded row: RotaryEmbedding
    np.array([[60, 61, 62, 63, 64], [60, 61, 62, 63, 64]]),  # past the tables: the exporter's
    np.array([[3], [11]]),  # one token per row, each at its own position: the kernel
], ids=["counted", "left-padded", "past-the-tables", "one-token"])
def test_outputs_stay_the_same(positions):
    original = _model()
    _, model = _folded(original)
    feeds = _feeds(*positions.shape, positions, np.random.default_rng(0))
    want = OrtRunner(original.SerializeToString(), "cpu").infer(feeds)
    got = OrtRunner(model.SerializeToString(), "cpu").infer(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=2e-6, err_msg=name)


@THREE_RUNS
def test_heads_normalised_before_the_rotation_are_read_normalised(positions):
    """Qwen3: q_norm / k_norm over each head's D, then the rotation. The kernel rotates the
    normalised heads joined again (the norm stays, on [B, S, heads, D]); same outputs."""
    original = _model(norm=True)
    folded, model = _folded(original)
    assert list(folded.blocks.values()) == ["position_ids"]
    branches = [a.g for node in model.graph.node for a in node.attribute if a.type == a.GRAPH]
    fast = [g for g in branches if any(x.name == "do_rotary" and x.i for n in g.node
                                       for x in n.attribute)]
    assert len(fast) == 1
    made = {out: n for n in fast[0].node for out in n.output}
    rotating = next(n for n in fast[0].node if n.op_type == "GroupQueryAttention")
    for read in rotating.input[:2]:  # Q and K: the norm's output, heads joined again
        assert made[read].op_type == "Reshape"
        assert made[made[read].input[0]].op_type == "SimplifiedLayerNormalization"
    assert rotating.input[2] == "v" and "Neg" not in [n.op_type for n in fast[0].node]
    feeds = _feeds(*positions.shape, positions, np.random.default_rng(1))
    _same_outputs(original, model, feeds)


def test_nothing_is_folded_where_cos_is_not_a_lookup_by_positions():
    folded, model = _folded(_model(offset_input=True))
    assert folded.blocks == {}
    assert all(n.op_type != "If" for n in model.graph.node)


def test_head_sizes_the_kernel_cannot_rotate_are_left():
    global D
    saved, D = D, 8  # onnxruntime 1.31: "head_size shall be a multiple of 16"
    try:
        folded, _ = _folded(_model())
    finally:
        D = saved
    assert folded.blocks == {}


@pytest.mark.parametrize("past, position", [(10, 3), (4, 5), (70, 3)],
                         ids=["total-past-the-tables", "inside", "far-past"])
def test_a_step_whose_total_passes_the_tables_takes_the_exporters_rotation(past, position):
    """onnxruntime 1.31 refuses a cos_cache shorter than total_sequence_length, whatever the
    positions (a left-padded row's position is below the total): guarded too."""
    original = _model(past=True)
    _, model = _folded(original, rows=8)
    rng = np.random.default_rng(1)
    feeds = _feeds(2, 1, np.array([[position], [position - 1]]), rng)
    feeds["past_key"] = rng.standard_normal((2, G, past, D)).astype(np.float32)
    feeds["past_value"] = rng.standard_normal((2, G, past, D)).astype(np.float32)
    want = OrtRunner(original.SerializeToString(), "cpu").infer(feeds)
    got = OrtRunner(model.SerializeToString(), "cpu").infer(feeds)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("ep", ["cpu", "cuda"])
def test_the_fold_is_only_for_the_cpu_kernel_it_was_measured_on(ep):
    """fuse --ep cuda (and tensorrt): how the GPU kernel reads position_ids was never
    measured (issue 14: no GPU run of it), so the fold is not on a GPU's list of passes."""
    from mha_onnx.rewrite.passes import Facts, FoldRotary, Guards, pipeline
    from mha_onnx.rewrite.policy import FormPolicy

    policy = FormPolicy.for_ep(ep)
    kinds = pipeline(policy)
    assert (FoldRotary in kinds) is (ep == "cpu")
    model = ir.from_proto(_model())  # (already lowered: the lowering's facts by hand)
    lowered = Facts.known(chosen={}, pairs={}, rows=None, shared=0)
    for kind in kinds[kinds.index(FoldRotary if ep == "cpu" else Guards):]:
        lowered = kind(policy, lowered)(model).facts
    nodes = ir.traversal.RecursiveGraphIterator(model.graph)
    folded = [n for n in nodes if n.op_type == "GroupQueryAttention"
              and n.attributes.get("do_rotary") is not None]
    assert bool(folded) is (ep == "cpu")


def test_fuse_for_a_gpu_does_not_fold():
    from mha_onnx.rewrite import fuse
    from mha_onnx.rewrite.policy import FormPolicy

    for ep, rotated in (("cpu", True), ("cuda", False)):
        fused, _, notes = fuse.fuse_model(_model(), FormPolicy.for_ep(ep))
        assert any("rotate Q and K inside GroupQueryAttention" in n for n in notes) is rotated
        assert any(a.name == "do_rotary" and a.i for n in all_nodes(fused.graph)
                   for a in n.attribute) is rotated, notes


def test_equal_tables_are_one_pair_of_initializers():
    """An exporter that computes cos/sin once per layer gives each layer its own values; the
    tables they hold are compared by content, so the model gets one pair, not one per layer."""
    from mha_onnx.rewrite.tighten.rotary_fold import _tables
    from mha_onnx.rewrite.tighten.rotary_match import rotated

    model = ir.from_proto(_model())
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    found = rotated(gqa.inputs[0], N)
    first = _tables(model, found, 64, [])
    count = len(model.graph.initializers)
    assert first is not None and _tables(model, found, 64, [first]) is first
    assert len(model.graph.initializers) == count


def test_forms_mark_each_kernel_that_rotates():
    """A cached block's step kernel and its prompt kernel (the form with NO_PAST) each get a
    rotating form in front of them; a block without a cache has one kernel, for both."""
    prompt = either("no past", "GQA (causal)", "MHA + bias", cases=(NO_PAST,))
    cached = either("one new token", "GQA with past", prompt, cases=(ONE_TOKEN,))
    both = rotating_kernels(cached, "position_ids", step=True, prompt=True)
    assert both.label == ("If(one new token, positions in the tables): GQA with past, rotary "
                          "inside | If(one new token): GQA with past | If(no past, positions "
                          "counted): GQA (causal), rotary inside | If(no past, positions in "
                          "the tables): RotaryEmbedding, GQA (causal) | If(no past): GQA "
                          "(causal) | MHA + bias")
    assert [COUNTED in f.cases for f in both.chain()] == [True, False, True, False, False,
                                                           False]
    only_prompt = rotating_kernels(cached, "p", step=False, prompt=True)
    assert [f.kernel for f in only_prompt.chain()][:4] == [
        "GQA with past", "GQA (causal), rotary inside", "RotaryEmbedding, GQA (causal)",
        "GQA (causal)"]
    plain = rotating_kernels(either("right padding", "GQA", "MHA"), "p", step=False,
                             prompt=True)
    assert plain.label == ("If(right padding, positions counted): GQA, rotary inside | "
                           "If(right padding, positions in the tables): RotaryEmbedding, GQA | "
                           "If(right padding): GQA | MHA")


@pytest.mark.parametrize("rotary, folds", [(16, True), (8, False)],
                         ids=["16-of-32", "8-of-32 (not 16k)"])
@THREE_RUNS
def test_a_partial_rotary_rotates_inside_on_its_first_dims(rotary, folds, positions):
    """GPT-NeoX's, Phi's and StableLM's rotary_pct: each head's first dims rotated, the rest
    passed through; the kernel rotates as many (cos_cache [positions, rotary / 2]) where that
    is a multiple of 16 (ORT: cos_cache dim 1 a multiple of 8), and the outputs stay."""
    global D
    saved, D = D, 32
    try:
        original = _model(rotary=rotary)
        folded, model = _folded(original)
        feeds = _feeds(*positions.shape, positions, np.random.default_rng(2))
    finally:
        D = saved
    assert (list(folded.blocks.values()) == ["position_ids"]) is folds
    if folds:
        caches = [t for t in model.graph.initializer if t.name.startswith("rotary_cos_cache")]
        assert [list(t.dims) for t in caches] == [[64, rotary // 2]]
    _same_outputs(original, model, feeds)


@pytest.mark.parametrize("rotary", [0, 16], ids=["whole head", "partial 16-of-32"])
@THREE_RUNS
def test_an_interleaved_rotation_rotates_inside_interleaved(rotary, positions):
    """Cohere's and Helium's rotation pairs dims (2i, 2i + 1): the kernel rotates with
    rotary_interleaved=1 from tables of every other column (each frequency is there twice in
    a row); the outputs stay."""
    global D
    saved, D = D, 32
    try:
        original = _model(rotary=rotary, interleaved=True)
        folded, model = _folded(original)
        feeds = _feeds(*positions.shape, positions, np.random.default_rng(3))
    finally:
        D = saved
    assert list(folded.blocks.values()) == ["position_ids"]
    kernels = [n for node in model.graph.node for a in node.attribute if a.type == a.GRAPH
               for n in a.g.node if n.op_type == "GroupQueryAttention"]
    assert [{a.name: a.i for a in n.attribute}.get("rotary_interleaved") for n in kernels
            if any(a.name == "do_rotary" and a.i for a in n.attribute)] == [1]
    _same_outputs(original, model, feeds)


def _rotating_kernels(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for node in model.graph.node for a in node.attribute if a.type == a.GRAPH
            for n in a.g.node if n.op_type == "GroupQueryAttention"
            and any(x.name == "do_rotary" and x.i for x in n.attribute)]


@pytest.mark.parametrize("shape", [
    {"before": True, "interleaved": True, "rotary": 16},  # GPT-J
    {"before": True, "sliced": True, "interleaved": True, "rotary": 16},  # CodeGen
    {"sliced": True, "rotary": 16},  # GPT-NeoX
    {"before": True},
], ids=["gptj", "codegen", "gpt-neox", "before-whole-head"])
@THREE_RUNS
def test_rotations_before_the_transpose_or_of_sliced_heads_rotate_inside(shape, positions):
    """GPT-J and CodeGen rotate [B, S, heads, D] before the heads' transpose (cos/sin
    [B, S, 1, D], computed for Q and for K apart); CodeGen's and GPT-NeoX's heads are slices
    of a fused projection, not a split of one [B, S, heads*D] tensor: the kernel then reads
    the unrotated heads joined again. The outputs stay."""
    global D
    saved, D = D, 32
    try:
        original = _model(**shape)
        folded, model = _folded(original)
        feeds = _feeds(*positions.shape, positions, np.random.default_rng(4))
    finally:
        D = saved
    assert list(folded.blocks.values()) == ["position_ids"]
    kernels = _rotating_kernels(model)
    assert len(kernels) == 1
    if shape.get("sliced"):  # the heads joined again, not a graph input
        assert kernels[0].input[0] not in ("q", "k")
    else:
        assert list(kernels[0].input[:3]) == ["q", "k", "v"]
    assert "Neg" not in _ops(model)  # the exporter's rotation moved into the other branch
    _same_outputs(original, model, feeds)


@pytest.mark.parametrize("rows, kept", [(100, 100), (200, 128), (20, 0)],
                         ids=["shorter-than-asked", "longer", "too-short-to-fold"])
def test_a_looked_up_table_is_cut_where_it_ends(rows, kept):
    """GPT-J and CodeGen gather cos/sin from a table of n_positions rows: the kernel's
    tables hold the rows the exporter's table has (at most as many as asked for, 128 here),
    and a table under MIN_POSITIONS rows is not folded; outputs stay, inside the tables and
    past the kernel's (a step at a position the exporter's table has, ours not)."""
    from mha_onnx.rewrite.tighten.rotary_fold import MIN_POSITIONS

    assert MIN_POSITIONS > 20
    original = _model(lookup=rows, before=True, interleaved=True)
    folded, model = _folded(original, rows=128)
    assert folded.rows == ((kept,) if kept else ())
    caches = [t for t in model.graph.initializer if t.name.startswith("rotary_cos_cache")]
    assert [t.dims[0] for t in caches] == ([kept] if kept else [])
    rng = np.random.default_rng(5)
    for positions in (np.array([[3, 4, 5]]), np.array([[rows - 1]]), np.array([[rows - 2]])):
        feeds = _feeds(*positions.shape, positions, rng)
        want = OrtRunner(original.SerializeToString(), "cpu").infer(feeds)
        got = OrtRunner(model.SerializeToString(), "cpu").infer(feeds)
        np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=5e-6)
