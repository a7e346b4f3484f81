"""rewrite/passes.py: fuse as a list of passes per target, each with its settings in
__init__, returning what it counted, its notes and the facts it found; a pass off its
target's list, or before the pass whose facts it needs, refuses to run by name."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from mha_onnx.rewrite.fusion_pass import FusionResult
from mha_onnx.rewrite.irutil import MS_DOMAIN
from mha_onnx.rewrite.passes import (
    ONNX_PASSES,
    ORT_PASSES,
    Facts,
    FoldRotary,
    FuseNorms,
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
    cpu = pipeline(FormPolicy.for_ep("cpu"))
    cuda = pipeline(FormPolicy.for_ep("cuda"))
    onnx_list = pipeline(FormPolicy(target="onnx"))
    assert cpu == list(ORT_PASSES) and onnx_list == list(ONNX_PASSES)
    # measured on the CPU kernels only: not on a GPU's list
    assert cuda == [k for k in ORT_PASSES if k not in (ResidualSums, FoldRotary,
                                                      PackKernelInputs)]
    assert cpu[:3] == [Prepare, Normalise, Recognise] and cpu[-1] is Tidy


@pytest.mark.parametrize("kind, policy", [
    (LowerToOrt, FormPolicy(target="onnx")), (LowerToOnnx, FormPolicy()),
    (ResidualSums, FormPolicy.for_ep("cuda")), (FoldRotary, FormPolicy.for_ep("cuda"))])
def test_a_pass_off_its_list_refuses_to_run(kind, policy):
    with pytest.raises(ir.passes.PreconditionError, match=kind.__name__):
        kind(policy)(ir.from_proto(_attention()))


@pytest.mark.parametrize("kind, missing, giver", [
    (Guards, "pairs, rows, shared", "LowerToOrt"), (FoldRotary, "chosen", "LowerToOrt"),
    (RecordCache, "chosen, pairs, rows, shared, from_shapes", "Guards, LowerToOrt")])
def test_a_pass_before_the_one_whose_facts_it_needs_refuses_by_name(kind, missing, giver):
    """The list in another order stops at the first pass that lacks a fact, and says which
    pass gives it; no pass reads a default where an earlier one should have spoken."""
    with pytest.raises(ir.passes.PreconditionError,
                       match=f"{kind.__name__} needs {missing} from an earlier pass \\({giver}\\)"):
        kind()(ir.from_proto(_attention()))
    reordered = [Prepare, Normalise, Recognise, Guards, LowerToOrt, RecordCache, Tidy]
    with pytest.raises(ir.passes.PreconditionError, match="Guards needs"):
        run_pipeline(ir.from_proto(_attention()), kinds=reordered)


def test_facts_are_new_each_pass_never_edited():
    m = ir.from_proto(_attention())
    start = Facts()
    prepared = Prepare(FormPolicy(), start)(m)
    recognised = Recognise(FormPolicy(), prepared.facts)(m)
    lowered = LowerToOrt(FormPolicy(), recognised.facts)(m)
    assert isinstance(lowered, FusionResult) and lowered.modified
    assert start.given == prepared.facts.given == frozenset() and not start.chosen
    assert recognised.facts.given == {"before", "blog"} and not recognised.facts.chosen
    assert lowered.facts.given == {"before", "blog", "chosen", "pairs", "rows", "shared"}
    assert list(lowered.facts.chosen) == [b.node for b in recognised.facts.before]
    assert lowered.counts == {"lowered": 1, "cache_pairs": 0}


def test_prepare_names_nodes_once_and_raises_the_opset_for_onnx():
    proto = _attention()
    for n in proto.graph.node:
        n.name = "same"
    for target, upgraded in (("ort", 0), ("onnx", 18)):
        m = ir.from_proto(proto)
        result = Prepare(FormPolicy(target=target))(m)
        assert result.counts["renamed"] == len(proto.graph.node) - 1
        assert len({n.name for n in m.graph}) == len(list(m.graph))
        assert result.counts.get("upgraded_from", 0) == upgraded
        assert bool(result.notes) is bool(upgraded)


def test_normalise_counts_masks_on_a_view_of_the_scores():
    from tests.rewrite.test_windows import H, N, _view

    m = ir.from_proto(_view([-1, H, N, N]))
    ir.passes.common.ShapeInferencePass()(m)  # (Prepare's, before it in the list)
    result = Normalise()(m)
    assert result.modified and result.counts["views"] == 1
    assert result.notes == (Normalise.NOTES["views"].format(n=1),)


@pytest.mark.parametrize("target, kernel", [("ort", "MultiHeadAttention"),
                                            ("onnx", "Attention")])
def test_recognise_then_lower_then_tidy(target, kernel):
    policy = FormPolicy(target=target)
    m = ir.from_proto(_attention())
    facts, _ = run_pipeline(m, policy, kinds=[Prepare, Recognise])
    assert facts.blog.matched and "Sdpa" in _ops(m)
    lowered = (LowerToOrt if target == "ort" else LowerToOnnx)(policy, facts)(m)
    assert lowered.counts["lowered"] == 1 and kernel in _ops(m)
    Tidy(policy, lowered.facts)(m)
    assert FUSION_DOMAIN not in m.opset_imports and "Sdpa" not in _ops(m)


def test_the_whole_list_gives_forms_and_notes():
    m = ir.from_proto(_attention())
    facts, notes = run_pipeline(m)
    assert list(facts.chosen) == [b.node for b in facts.before]
    assert notes == [] and facts.cache is None  # nothing to say, no cache


def test_norms_and_residual_sums():
    from tests.rewrite.test_norms import _model as rms_model

    m = ir.from_proto(rms_model())
    norms = FuseNorms()(m)
    assert norms.counts["norms"] > 0 and "SimplifiedLayerNormalization" in " ".join(_ops(m))
    x = [helper.make_tensor_value_info(n, F, ["B", 8]) for n in "ab"]
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["h"]),
         helper.make_node("LayerNormalization", ["h", "g", "beta"], ["y"], axis=-1)],
        "g", x, [helper.make_tensor_value_info("y", F, ["B", 8])],
        initializer=[onnx.numpy_helper.from_array(np.ones(8, np.float32), "g"),
                     onnx.numpy_helper.from_array(np.zeros(8, np.float32), "beta")])
    m = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    sums = ResidualSums()(m)
    assert sums.counts == {"sums": 1} and "Sum" in _ops(m) and sums.notes


def test_rotary_guards_and_packing_on_a_lowered_model():
    from tests.rewrite.test_rotary import _model as rotary_model

    m = ir.from_proto(rotary_model())  # (already lowered: the lowering's facts by hand)
    lowered = Facts.known(chosen={}, pairs={}, rows=None, shared=0)
    facts, notes = run_pipeline(m, kinds=[FoldRotary, Guards, PackKernelInputs], facts=lowered)
    assert facts.rotating.blocks and any("rotate Q and K" in n for n in notes)
    assert any(n.op_type == "GroupQueryAttention" and n.attributes.get("do_rotary")
               for n in ir.traversal.RecursiveGraphIterator(m.graph))
    assert facts.from_shapes is False and "packed" in facts.given


def test_the_cache_record_after_lowering():
    m = cached_model(Meaning(causal=True, alignment="bottom-right", kv_heads=2))
    lowered = LowerToOrt()(m)
    assert MS_DOMAIN in m.opset_imports
    guarded = Guards(FormPolicy(), lowered.facts)(m)
    record = RecordCache(FormPolicy(), guarded.facts)(m)
    assert record.counts["pairs"] == 2 and record.facts.cache["form"] == "appended"
    assert record.facts.cache["pairs"] == {"past_k": "present_k", "past_v": "present_v"}
