"""rewrite/passes.py: fuse as a list of passes per target, each counting what it did; a pass
off its target's list refuses to run; notes come from the counts."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from mha_onnx.rewrite.irutil import MS_DOMAIN
from mha_onnx.rewrite.passes import (
    ONNX_PASSES,
    ORT_PASSES,
    FoldRotary,
    FuseNorms,
    FuseRun,
    Guards,
    LowerToOnnx,
    LowerToOrt,
    Normalise,
    PackKernelInputs,
    Prepare,
    Recognise,
    RecordCache,
    ResidualSums,
    Tidy,
    pipeline,
    run_pipeline,
)
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.sdpa import FUSION_DOMAIN
from tests.irgraphs import F, const, model, node, qkv_inputs
from tests.sdpa_graphs import Meaning, cached_model


def _attention() -> onnx.ModelProto:
    """out = Softmax(q·k^T / sqrt(8))·v, q/k/v [B, 2, S, 8]."""
    nodes = [node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], "s"),
             const("scale", 8 ** -0.5), node("Mul", ["s", "scale"], "scaled"),
             node("Softmax", ["scaled"], "p", axis=-1), node("MatMul", ["p", "v"], "out")]
    return model(nodes, qkv_inputs(), ["out"])


def _ops(m: ir.Model) -> list[str]:
    return [n.op_type for n in ir.traversal.RecursiveGraphIterator(m.graph)]


def test_each_target_and_provider_has_its_list():
    cpu = [type(p) for p in pipeline(FuseRun(FormPolicy.for_ep("cpu")))]
    cuda = [type(p) for p in pipeline(FuseRun(FormPolicy.for_ep("cuda")))]
    onnx_list = [type(p) for p in pipeline(FuseRun(FormPolicy(target="onnx")))]
    assert cpu == list(ORT_PASSES) and onnx_list == list(ONNX_PASSES)
    # measured on the CPU kernels only: not on a GPU's list
    assert cuda == [k for k in ORT_PASSES if k not in (ResidualSums, FoldRotary,
                                                      PackKernelInputs)]
    assert cpu[:3] == [Prepare, Normalise, Recognise] and cpu[-1] is Tidy


@pytest.mark.parametrize("kind, run", [
    (LowerToOrt, FuseRun(FormPolicy(target="onnx"))), (LowerToOnnx, FuseRun()),
    (ResidualSums, FuseRun(FormPolicy.for_ep("cuda"))),
    (FoldRotary, FuseRun(FormPolicy.for_ep("cuda")))])
def test_a_pass_off_its_list_refuses_to_run(kind, run):
    with pytest.raises(ir.passes.PreconditionError, match=kind.__name__):
        kind(run)(ir.from_proto(_attention()))


def test_prepare_names_nodes_once_and_raises_the_opset_for_onnx():
    proto = _attention()
    for n in proto.graph.node:
        n.name = "same"
    for target, upgraded in (("ort", 0), ("onnx", 18)):
        m = ir.from_proto(proto)
        prepare = Prepare(FuseRun(FormPolicy(target=target)))
        prepare(m)
        assert prepare.counts["renamed"] == len(proto.graph.node) - 1
        assert len({n.name for n in m.graph}) == len(list(m.graph))
        assert prepare.counts.get("upgraded_from", 0) == upgraded
        assert bool(prepare.notes()) is bool(upgraded)


def test_normalise_counts_masks_on_a_view_of_the_scores():
    from tests.rewrite.test_windows import H, N, _view

    m = ir.from_proto(_view([-1, H, N, N]))
    ir.passes.common.ShapeInferencePass()(m)  # (Prepare's, before it in the list)
    normalise = Normalise(FuseRun())
    result = normalise(m)
    assert result.modified and normalise.counts["views"] == 1
    assert normalise.notes() == [Normalise.NOTES["views"].format(n=1)]


@pytest.mark.parametrize("target, kernel", [("ort", "MultiHeadAttention"),
                                            ("onnx", "Attention")])
def test_recognise_then_lower_then_tidy(target, kernel):
    run = FuseRun(FormPolicy(target=target))
    m = ir.from_proto(_attention())
    for kind in (Prepare, Recognise):
        kind(run)(m)
    assert run.blog.matched and "Sdpa" in _ops(m)
    lower = (LowerToOrt if target == "ort" else LowerToOnnx)(run)
    lower(m)
    assert lower.counts["lowered"] == 1 and kernel in _ops(m)
    Tidy(run)(m)
    assert FUSION_DOMAIN not in m.opset_imports and "Sdpa" not in _ops(m)


def test_the_whole_list_gives_forms_and_notes():
    run = FuseRun()
    m = ir.from_proto(_attention())
    notes = run_pipeline(m, run)
    assert list(run.chosen) == [b.node for b in run.before]
    assert notes == [] and run.cache is None  # nothing to say, no cache


def test_norms_and_residual_sums():
    from tests.rewrite.test_norms import _model as rms_model

    m = ir.from_proto(rms_model())
    norms = FuseNorms(FuseRun())
    norms(m)
    assert norms.counts["norms"] > 0 and "SimplifiedLayerNormalization" in " ".join(_ops(m))
    x = [helper.make_tensor_value_info(n, F, ["B", 8]) for n in "ab"]
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["h"]),
         helper.make_node("LayerNormalization", ["h", "g", "beta"], ["y"], axis=-1)],
        "g", x, [helper.make_tensor_value_info("y", F, ["B", 8])],
        initializer=[onnx.numpy_helper.from_array(np.ones(8, np.float32), "g"),
                     onnx.numpy_helper.from_array(np.zeros(8, np.float32), "beta")])
    m = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    sums = ResidualSums(FuseRun())
    sums(m)
    assert sums.counts == {"sums": 1} and "Sum" in _ops(m) and sums.notes()


def test_rotary_guards_and_packing_on_a_lowered_model():
    from tests.rewrite.test_rotary import _model as rotary_model

    run = FuseRun()
    m = ir.from_proto(rotary_model())
    fold, guards, pack = FoldRotary(run), Guards(run), PackKernelInputs(run)
    for each in (fold, guards, pack):
        each(m)
    assert fold.counts["rotating"] == 1 and any("rotate Q and K" in n for n in fold.notes())
    assert any(n.op_type == "GroupQueryAttention" and n.attributes.get("do_rotary")
               for n in ir.traversal.RecursiveGraphIterator(m.graph))
    assert "kernels" in pack.counts and guards.counts == {}


def test_the_cache_record_after_lowering():
    run = FuseRun()
    m = cached_model(Meaning(causal=True, alignment="bottom-right", kv_heads=2))
    LowerToOrt(run)(m)
    assert MS_DOMAIN in m.opset_imports
    record = RecordCache(run)
    record(m)
    assert record.counts["pairs"] == 2 and run.cache["form"] == "appended"
    assert run.cache["pairs"] == {"past_k": "present_k", "past_v": "present_v"}
