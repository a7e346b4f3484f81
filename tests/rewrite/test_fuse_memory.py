"""Fusing without holding a model's weights more times than it must: verification one
session at a time from files whose weights the sessions read in place, with the same verdict
as sessions made from bytes."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from mha_onnx.graph.files import read_model, write_model
from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.check.cases import verification_cases
from mha_onnx.rewrite.check.verify import verify

pytestmark = pytest.mark.models


def test_verification_from_files_gives_the_verdict_from_bytes(zoo, tmp_path):
    """With a scratch folder each model is a file there (weights beside it, read in place,
    MatMuls unpacked) and the original's outputs are read first, large ones kept on disk:
    the same comparisons, case by case, as two sessions made from bytes."""
    original = zoo("hf_cached_llama")
    fused, results, _ = fuse_model(original)
    cases = verification_cases(original, results)
    in_memory = verify(original, fused, cases=cases)
    on_disk = verify(original, fused, cases=cases, scratch=tmp_path)
    assert in_memory.passed and on_disk.passed
    assert [(r.case, r.output, r.stats.max_abs) for r in on_disk.results] == \
        [(r.case, r.output, r.stats.max_abs) for r in in_memory.results]
    written = sorted(p.name for p in tmp_path.iterdir())
    assert "original.onnx" in written and "fused.onnx" in written
    assert "original.onnx.data" in written  # (the weights beside it, not inside)


def test_a_model_without_large_tensors_is_written_with_external_data_asked(tmp_path):
    """``external=True`` on a model whose tensors are all under 1 KiB: the model alone (the
    data file is not made, and nothing fails for its absence)."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path = write_model(model, tmp_path / "small.onnx", force=True, external=True)
    assert read_model(path).graph.node[0].op_type == "Relu"
    assert not (tmp_path / "small.onnx.data").exists()
