"""The original kept inside a fused or tuned model (mha_onnx.graph.original): given back exactly,
its weights found in the written model (by content, or as a slice of a packed one), not
stored twice; ``mha-onnx tune`` of a fused model tunes it again from it."""

from __future__ import annotations

import base64
import zlib

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from mha_onnx.cli import main
from mha_onnx.graph import metadata
from mha_onnx.graph.original import record, restore
from tests.conftest import SMALL
from tests.paths import OPTIMUM

FIXTURES = OPTIMUM


def _same(restored: onnx.ModelProto, original: onnx.ModelProto) -> None:
    assert restored.graph.node == original.graph.node
    assert restored.graph.input == original.graph.input
    assert restored.graph.output == original.graph.output
    assert [t.name for t in restored.graph.initializer] == \
        [t.name for t in original.graph.initializer]
    for mine, theirs in zip(restored.graph.initializer, original.graph.initializer, strict=True):
        a, b = numpy_helper.to_array(mine), numpy_helper.to_array(theirs)
        assert a.dtype == b.dtype and np.array_equal(a, b), mine.name


def _kept_bytes(model: onnx.ModelProto) -> int:
    kept = onnx.ModelProto.FromString(zlib.decompress(base64.b64decode(
        metadata.read(model)["original"])))
    return sum(numpy_helper.to_array(t).nbytes for t in kept.graph.initializer)


def test_a_fused_export_keeps_its_original_without_its_weights_twice(export_cache, tmp_path):
    from mha_onnx.rewrite import fuse_file

    src = export_cache(SMALL.replace(mask="key-padding"))
    fuse_file(src, tmp_path / "f.onnx")
    fused = onnx.load(tmp_path / "f.onnx")
    assert metadata.loaded(fused, "packed")  # (Q, K and V packed: found as slices)
    _same(restore(fused), onnx.load(src))
    assert _kept_bytes(fused) < 64  # (a few shape constants fuse dropped; no weight)
    assert "kept for `mha-onnx tune`" in metadata.decoded(fused)["original"]  # (not base64)


@pytest.mark.parametrize("name", ["gpt2/model", "llama/model", "bert/model"])
@pytest.mark.models
def test_optimum_exports_fused_give_their_original_back(name, tmp_path):
    from mha_onnx.rewrite import fuse_file

    src = FIXTURES / f"{name}.onnx"
    fuse_file(src, tmp_path / "f.onnx", verify_result=False)
    fused = onnx.load(tmp_path / "f.onnx")
    original = onnx.load(src)
    _same(restore(fused), original)
    total = sum(numpy_helper.to_array(t).nbytes for t in original.graph.initializer)
    assert _kept_bytes(fused) < 0.25 * total  # (what fuse no longer holds: mask buffers)


def test_a_weight_neither_held_nor_packed_is_kept_and_a_model_without_record_is_none():
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [w])
    original = helper.make_model(graph)
    other = onnx.ModelProto()
    other.CopyFrom(original)
    other.graph.initializer[0].CopyFrom(helper.make_tensor("w", TensorProto.FLOAT, [2],
                                                           [1.0, 3.0]))
    assert restore(other) is None
    assert record(original, other)
    assert _kept_bytes(other) == 8
    _same(restore(other), original)


def test_tune_of_a_fused_model_tunes_it_from_its_original(export_cache, tmp_path):
    src = export_cache(SMALL.replace(mask="causal"))
    fused = tmp_path / "f.onnx"
    assert CliRunner().invoke(main, ["fuse", str(src), "-o", str(fused)]).exit_code == 0
    result = CliRunner().invoke(main, ["tune", str(fused), "-o", str(tmp_path / "t.onnx"),
                                       "--tune-batch", "1", "--tune-seq-lens", "16,64",
                                       "--tune-threads", "1"])
    assert result.exit_code == 0, result.output
    assert "is fused: tuning again from the original it keeps" in result.output
    tuned = onnx.load(tmp_path / "t.onnx")
    _same(restore(tuned), onnx.load(src))
