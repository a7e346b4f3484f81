"""lower_rows (``--kv-cache shared`` with per-row lengths): the buffer layout the graph
writes is the one cache.py reads and feeds (kept keys first, a step written after them),
which padding inputs it reads the rows from, and the forms a left-padded batch takes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from mha_onnx.graph import cache as kv
from mha_onnx.rewrite.lower import rows as rows
from mha_onnx.rewrite.lower.common import TapeOps
from mha_onnx.rewrite.policy import FormPolicy
from tests.irgraphs import B64, BOOL, Graph, model, node, tensor

F32 = onnx.TensorProto.FLOAT


def _run(build, feeds: dict[str, np.ndarray], types: dict[str, ir.DataType]):
    """Build a graph of ``build(ops, *inputs)`` (inputs typed by ``types``) and run it."""
    inputs = [ir.Value(name=name, type=ir.TensorType(t)) for name, t in types.items()]
    ops = TapeOps()
    outs = build(ops, *inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    for n, out in enumerate(outs):
        out.name = f"out{n}"
    graph = ir.Graph(inputs, list(outs), nodes=ops.tape.nodes, opset_imports={"": 18})
    proto = ir.to_proto(ir.Model(graph, ir_version=10))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


KEEP = np.array([[1, 1, 1, 1, 1, 1],  # nothing padded
                 [0, 0, 1, 1, 1, 1],  # left padding
                 [1, 1, 1, 0, 0, 0],  # right padding
                 [0, 1, 0, 1, 1, 0],  # holes
                 [0, 0, 0, 0, 0, 0]], np.int32)  # every key padded


def test_the_graph_orders_rows_kept_first_as_the_wrapper_does():
    """kept_first/inverse/gather_cache in the graph == cache.kept_first in numpy: the layout
    a buffer is fed in (wrapper) and the one a prompt writes (graph) are one."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 2, 6, 3)).astype(np.float32)  # [B, G, L, D]

    def build(ops, keep, x4):
        dest = rows.kept_first(ops, keep)
        return dest, rows.gather_cache(ops, x4, rows.inverse(ops, dest))

    dest, ordered = _run(build, {"keep": KEEP, "x": x},
                         {"keep": ir.DataType.INT32, "x": ir.DataType.FLOAT})
    np.testing.assert_array_equal(ordered, kv.kept_first(x, KEEP.astype(bool)))
    for b in range(5):  # a permutation: kept positions at [0, n_b), in order
        assert sorted(dest[b]) == list(range(6))
        np.testing.assert_array_equal(dest[b][KEEP[b] == 1], np.arange(KEEP[b].sum()))


def test_a_step_is_written_after_each_rows_kept_keys_and_read_back_logically():
    """_written puts S new positions at [n_b, n_b + S) of each row (kept-first); the
    wrapper's logical_present reads them back to the appended layout exactly, the cached
    padded positions from the past it was given."""
    rng = np.random.default_rng(1)
    past = rng.standard_normal((5, 2, 6, 3)).astype(np.float32)
    new = rng.standard_normal((5, 2, 2, 3)).astype(np.float32)
    keep_new = np.array([[1, 1], [1, 0], [0, 1], [1, 1], [0, 0]], np.int32)
    keep = np.concatenate([KEEP, keep_new], axis=1).astype(bool)
    buffer = np.full((5, 2, 11, 3), np.nan, np.float32)
    buffer[:, :, :6] = kv.kept_first(past, KEEP.astype(bool))
    kept = KEEP.sum(axis=1, keepdims=True).astype(np.int64)

    def build(ops, buf, new4, keep_new_, kept_):
        ordered = rows.gather_cache(ops, new4, rows.inverse(ops, rows.kept_first(ops, keep_new_)))
        return rows._written(ops, buf, ordered, kept_)

    (written,) = _run(build, {"buf": buffer, "new": new, "keep_new": keep_new, "kept": kept},
                      {"buf": ir.DataType.FLOAT, "new": ir.DataType.FLOAT,
                       "keep_new": ir.DataType.INT32, "kept": ir.DataType.INT64})
    np.testing.assert_array_equal(kv.logical_present(written, past, keep),
                                  np.concatenate([past, new], axis=2))
    for b in range(5):  # nothing of the row beyond the step is touched
        end = int(kept[b, 0]) + 2
        np.testing.assert_array_equal(written[b, :, end:], buffer[b, :, end:])


def _padding(nodes, mask_type=B64):
    return Graph(model(nodes, [tensor("m", mask_type, ["B", "T"])], ["p"]))["p"]


@pytest.mark.parametrize(("nodes", "mask_type", "zero_is_padded"), [
    ([node("Identity", ["m"], "p")], BOOL, False),  # PyTorch: True = padded
    ([node("Not", ["m"], "p")], BOOL, True),  # a bool keep mask
    ([node("Constant", [], "z", value_float=0.0), node("Cast", ["m"], "f", to=F32),
      node("CastLike", ["z", "f"], "z2"), node("Equal", ["f", "z2"], "p")], B64, True),
    ([node("Constant", [], "z", value_int=0), node("Equal", ["m", "z"], "e"),
      node("Not", ["e"], "p")], B64, False),
], ids=["bool-padded", "not-bool", "equal-zero-through-cast", "not-equal-zero"])
def test_the_rows_are_read_from_a_padding_input_in_either_polarity(nodes, mask_type,
                                                                   zero_is_padded):
    padded = _padding(nodes, mask_type)
    if padded.producer() is not None and padded.producer().op_type == "Identity":
        padded = padded.producer().inputs[0]
    assert rows.row_source(padded) == rows.RowSource("m", zero_is_padded)


@pytest.mark.parametrize("nodes", [
    [node("Constant", [], "one", value_int=1), node("Equal", ["m", "one"], "p")],  # == 1
    [node("Constant", [], "z", value_int=0), node("Add", ["m", "m"], "s"),
     node("Equal", ["s", "z"], "p")],  # not the input itself
], ids=["equal-one", "computed"])
def test_near_misses_are_not_read_as_rows(nodes):
    assert rows.row_source(_padding(nodes)) is None


def _gqa_runs(path, feeds) -> int:
    """How many GroupQueryAttention nodes ORT ran for ``feeds`` (its profile)."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(path.parent / "profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    with open(session.end_profiling()) as f:
        events = json.load(f)
    return sum(1 for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
               and e["args"]["op_name"] == "GroupQueryAttention")


@pytest.mark.models
def test_an_optimum_llama_left_padded_batch_stays_on_gqa(tmp_path):
    """The Optimum Llama export with --kv-cache shared: a left-padded prompt and a step after
    it run GQA in both layers (a batch with holes takes the general form), so does a
    prompt's later chunk in one row (its past padded or not; in a batch of four, the general
    form), and validate's decode chains through the per-row buffers match the appended
    export."""
    from click.testing import CliRunner

    from mha_onnx.cli import main
    from mha_onnx.graph.inputs import ShapeCase, case_for, make_inputs
    from tests.rewrite.test_optimum import FIXTURES

    src, out = FIXTURES / "llama" / "model.onnx", tmp_path / "shared.onnx"
    result = CliRunner().invoke(main, ["fuse", str(src), "-o", str(out), "--kv-cache", "shared"])
    assert result.exit_code == 0, result.output
    fused = onnx.load(out)
    assert kv.row_layout(fused) == {"input": "attention_mask", "zero_is_padded": True}
    assert not kv.takes_length(fused)  # GenAI's contract: the cached length from the shapes
    specs, pairs = kv.shared_view(fused)
    for batch, past, new, padding, gqa in [
            (4, 0, 12, "left", 2), (4, 12, 1, "left", 2), (4, 0, 12, "some", 0),
            (1, 12, 5, "none", 2), (1, 12, 5, "front", 2), (4, 12, 5, "none", 0)]:
        dims = case_for(specs, "x", batch, [new]).dims
        dims.update({s.dims[2]: past for s in specs if s.name in pairs})
        feeds = make_inputs(specs, ShapeCase("x", dims, padding, pad_fraction=0.25))
        shared = kv.to_shared(feeds, specs, pairs, rows=kv.row_layout(fused),
                              length_input=kv.takes_length(fused))
        assert _gqa_runs(out, shared) == gqa, (batch, past, new, padding)
    result = CliRunner().invoke(main, ["validate", str(out), "--reference", str(src)])
    assert result.exit_code == 0 and "decode step 16" in result.output, result.output
    # validate says which kernels the steps ran: left-padded or not, GQA in both layers
    for step in ("decode prompt", "decode step 1", "decode (no key padded) step 16"):
        assert f"kernels run on ORT CPU at {step}: GroupQueryAttention x2" in result.output


@pytest.mark.parametrize("form", ["appended", "shared"])
@pytest.mark.models
def test_genai_right_padded_batch_stays_on_gqa(tmp_path, form):
    """What ONNX Runtime GenAI feeds a batch: prompts right-padded, then steps whose mask
    has the padding as holes between a row's prompt and its new tokens; every run on
    GroupQueryAttention in both layers, in both cache forms (GenAI's generator itself runs
    these folders in tests/generate/test_generate.py)."""
    from mha_onnx.generate import Generator
    from mha_onnx.rewrite import fuse_file
    from tests.rewrite.test_optimum import FIXTURES

    out = tmp_path / "model.onnx"
    fuse_file(FIXTURES / "llama" / "model.onnx", out, policy=FormPolicy(kv_cache=form))
    iface = Generator(out).interface
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], np.int64)  # right-padded prompt
    feeds = {"input_ids": np.array([[5, 6, 7, 8, 9], [10, 11, 0, 0, 0]], np.int64),
             "attention_mask": mask, "position_ids": np.array([[0, 1, 2, 3, 4],
                                                               [0, 1, 0, 0, 0]], np.int64)}
    zeros = np.zeros((2, iface.kv_heads, 9 if form == "shared" else 0, iface.head_size),
                     np.float32)  # (a shared buffer: room for the prompt and the step)
    feeds.update({past: zeros for past, _ in iface.pasts})
    assert _gqa_runs(out, feeds) == 2
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(None, feeds), strict=True))
    step = {"input_ids": np.array([[3], [4]], np.int64),
            "attention_mask": np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1),
            "position_ids": np.array([[5], [2]], np.int64)}
    step.update({past: values[present] for past, present in iface.pasts})
    assert _gqa_runs(out, step) == 2
