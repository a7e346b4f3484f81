"""lower/rules.py: stage 2's rules for ONNX Runtime return every value they replace. On a
cached layer (keys = Concat(past, new), also the presents) the rule returns the presents
from the kernel in place of the Concats; where something else reads a Concat, the plain rule
applies and the Concat stays. prepare_caches lets a Shape of the cache and a K^T transposed
back read past the Concat. Each case runs on ORT against numpy attention."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.policy import FormPolicy
from tests.sdpa_graphs import (
    Meaning,
    assert_matches,
    cached_feeds,
    cached_model,
    lower_for_ort,
    reference,
    run_all,
)

MEANING = Meaning(causal=True, alignment="bottom-right", kv_heads=2)
RUNS = ((0, 5), (6, 1), (4, 3))  # (past, new): a prompt, a decode step, a chunk after a past


def _output(model: ir.Model, name: str) -> ir.Value:
    return next(o for o in model.graph.outputs if o.name == name)


def _add_output(model: ir.Model, node: ir.Node, name: str) -> None:
    model.graph.append(node)
    node.outputs[0].name = name
    model.graph.outputs.append(node.outputs[0])


def _check(model: ir.Model, extra=None) -> dict[str, np.ndarray]:
    got = {}
    for past, s in RUNS:
        f = cached_feeds(MEANING, 3, past, s)
        got = run_all(model, f)
        assert_matches(got["out"], reference(MEANING, f))
        for name in ("k", "v"):
            np.testing.assert_array_equal(got[f"present_{name}"], f[name])
        if extra is not None:
            extra(got, f)
    return got


def test_the_presents_come_from_the_kernel_and_no_concat_is_left():
    model = cached_model(MEANING)
    stage = lower_for_ort(model, FormPolicy())
    assert len(stage.layers) == 1 and stage.layers[0].kernel.op_type == "If"
    assert stage.pairs(model.graph) == {"past_k": "present_k", "past_v": "present_v"}
    assert _output(model, "present_k").producer() is stage.layers[0].kernel
    assert "Concat" not in {node.op_type for node in model.graph}
    _check(model)


def test_a_cache_something_else_reads_stays_a_concat_and_the_plain_rule_applies():
    model = cached_model(MEANING)
    present = _output(model, "present_k")
    _add_output(model, ir.Node("", "Identity", [present]), "k_copy")
    stage = lower_for_ort(model, FormPolicy())
    assert stage.layers == [] and stage.pairs(model.graph) == {}
    assert stage.forms["block0"].kernel == "MultiHeadAttention over the cache"
    assert _output(model, "present_k").producer().op_type == "Concat"
    _check(model, lambda got, f: np.testing.assert_array_equal(got["k_copy"], f["k"]))


def test_a_shape_of_the_cache_reads_its_parts():
    model = cached_model(MEANING)
    _add_output(model, ir.Node("", "Shape", [_output(model, "present_k")]), "k_shape")
    stage = lower_for_ort(model, FormPolicy())
    assert len(stage.layers) == 1  # the Shape did not keep the Concat
    _check(model, lambda got, f: np.testing.assert_array_equal(got["k_shape"], f["k"].shape))


def test_keys_transposed_twice_are_read_through():
    model = cached_model(MEANING)
    sdpa = next(n for n in model.graph if n.op_type == "Sdpa")
    there = ir.Node("", "Transpose", [sdpa.inputs[1]], attributes=[
        ir.AttrInt64s("perm", [0, 1, 3, 2])])
    back = ir.Node("", "Transpose", [there.outputs[0]], attributes=[
        ir.AttrInt64s("perm", [0, 1, 3, 2])])
    back.outputs[0].shape, back.outputs[0].dtype = sdpa.inputs[1].shape, MEANING.dtype
    model.graph.insert_before(sdpa, [there, back])
    sdpa.replace_input_with(1, back.outputs[0])
    stage = lower_for_ort(model, FormPolicy())
    assert len(stage.layers) == 1
    assert there.graph is None and back.graph is None  # removed: nothing reads them
    _check(model)
