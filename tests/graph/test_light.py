"""A model's structure apart from its weights (graph/light.py): what export, fuse and
validate read without holding one more copy of every weight."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mha_onnx.graph.files as graphio
from mha_onnx.errors import ModelFileError
from mha_onnx.graph import metadata
from mha_onnx.graph.copies import copy_model
from mha_onnx.graph.files import read_model, write_model
from mha_onnx.graph.light import (
    checkable,
    lend,
    model_bytes,
    structure,
    write_inline,
)
from mha_onnx.runtime.ort import OrtRunner


def _model(width: int = 64) -> onnx.ModelProto:
    """x @ w1 @ w2 (+ an If whose branch holds a tensor), a small shape constant kept."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), "w2")
    shape = numpy_helper.from_array(np.array([-1, width], np.int64), "shape")
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
            np.ones(width, np.float32)))], "b", [], [helper.make_tensor_value_info("c", 1, [width])])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("MatMul", ["h", "w2"], ["h2"]),
             helper.make_node("Reshape", ["h2", "shape"], ["y"]),
             helper.make_node("If", ["flag"], ["z"], then_branch=branch, else_branch=branch)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", 1, ["n", width]),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", 1, ["n", width]),
         helper.make_tensor_value_info("z", 1, [width])], [w1, w2, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    metadata.write(model, {"note": "kept"})
    return model


def _feeds(width: int = 64) -> dict:
    return {"x": np.ones((2, width), np.float32), "flag": np.array(True)}


def test_structure_leaves_the_weights_out_and_lend_gives_them_back_unchanged():
    model = _model()
    light, weights = structure(model, big=1024)
    assert sorted(weights) == ["w1", "w2"]  # (the shape constant stays in)
    described = {t.name: t for t in light.graph.initializer}
    assert not described["w1"].HasField("raw_data") and list(described["w1"].dims) == [64, 64]
    assert numpy_helper.to_array(described["shape"]).tolist() == [-1, 64]
    assert light.metadata_props[0].key == model.metadata_props[0].key
    assert model_bytes(light) < model_bytes(model) // 10
    made = ir.from_proto(light)
    assert lend(made, weights) == 2
    made.graph.initializers["w1"].name = "renamed"  # a pass renames a value
    back = ir.to_proto(made)
    assert [t.name for t in model.graph.initializer] == ["w1", "w2", "shape"]  # not written through
    arrays = {t.name: numpy_helper.to_array(t) for t in back.graph.initializer}
    np.testing.assert_array_equal(arrays["renamed"], numpy_helper.to_array(model.graph.initializer[0]))


def test_model_bytes_is_protobufs_own_size_without_encoding_the_model():
    for model in (_model(8), _model(300), onnx.ModelProto()):
        assert model_bytes(model) == model.ByteSize()


def test_a_weight_shorter_than_its_dims_is_refused_when_read(tmp_path):
    model = _model(1024)  # (4 MiB weights: judged here, not by onnx.checker)
    model.graph.initializer[0].raw_data = bytes(1 << 20)
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ModelFileError, match="too small for the declared shape"):
        read_model(tmp_path / "m.onnx")
    onnx.checker.check_model(checkable(_model(1024)))  # a whole one passes


def test_write_inline_gives_the_model_back_tensor_by_tensor(tmp_path):
    model = _model()
    written = write_model(model, tmp_path / "ext.onnx", force=True, external=True)
    light = onnx.load(str(written), load_external_data=False)
    with (tmp_path / "inline.onnx").open("wb") as handle:
        write_inline(light, tmp_path, handle)
    back = onnx.load(str(tmp_path / "inline.onnx"))
    assert back.ByteSize() == (tmp_path / "inline.onnx").stat().st_size
    for a, b in zip(back.graph.initializer, model.graph.initializer, strict=True):
        assert a.name == b.name and not onnx.external_data_helper.uses_external_data(a)
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    want = OrtRunner(model.SerializeToString()).infer(_feeds())
    got = OrtRunner(str(tmp_path / "inline.onnx")).infer(_feeds())
    np.testing.assert_array_equal(got["y"], want["y"])


def test_copy_model_writes_the_layout_write_model_would(tmp_path, monkeypatch):
    model = _model()
    scratch = write_model(model, tmp_path / "scratch.onnx", force=True, external=True)
    small = copy_model(scratch, tmp_path / "small.onnx")
    assert not (tmp_path / "small.onnx.data").exists()  # under 2 GB: one file, as before
    monkeypatch.setattr(graphio, "EXTERNAL_DATA_THRESHOLD", 1024)  # as if it were > 2 GB
    (tmp_path / "out").mkdir()
    big = copy_model(scratch, tmp_path / "out" / "big.onnx")
    assert (tmp_path / "out" / "big.onnx.data").exists()
    want = OrtRunner(model.SerializeToString()).infer(_feeds())
    for path in (small, big):
        np.testing.assert_array_equal(OrtRunner(str(path)).infer(_feeds())["y"], want["y"])
    (tmp_path / "scratch.onnx.data").unlink()  # the copy reads nothing of its source
    assert read_model(big).graph.initializer[0].name == "w1"


def test_fuse_model_lets_go_of_the_model_it_fused(export_cache, monkeypatch):
    """onnxscript's module-level rules keep the graph they last matched: fuse_model makes
    them let go (else the last model fused, and the weights it read, stayed in memory)."""
    import mha_onnx.rewrite.fuse as fuse
    from mha_onnx.config import MhaConfig

    seen = []
    real = fuse.to_ir

    def to_ir(model):
        made = real(model)
        seen.append(weakref.ref(made.graph))
        return made

    monkeypatch.setattr(fuse, "to_ir", to_ir)
    fused, results, _ = fuse.fuse_model(onnx.load(export_cache(MhaConfig(
        d_model=32, num_heads=4, name="ext"))))  # (test_graphio's: its export is recorded)
    assert results and fused.graph.node
    gc.collect()
    assert seen and seen[0]() is None


def test_validate_reads_an_exports_weights_only_where_it_needs_them(tmp_path):
    from mha_onnx.parity.config import ValidateConfig
    from mha_onnx.parity.references import model_to_validate

    model = _model()
    metadata.write(model, {"hf_model": {"folder": "f", "task": "feature-extraction"}})
    path = write_model(model, tmp_path / "hf.onnx", force=True, external=True)
    light = model_to_validate(path, ValidateConfig(memory_check=False))
    assert onnx.external_data_helper.uses_external_data(light.graph.initializer[0])
    loaded = model_to_validate(path, ValidateConfig(memory_check=False, ranges=True))
    assert not onnx.external_data_helper.uses_external_data(loaded.graph.initializer[0])
    inline = write_model(model, tmp_path / "inline.onnx", force=True)
    assert model_to_validate(inline, ValidateConfig(memory_check=False)).graph.initializer[0] \
        .HasField("raw_data")


def test_trial_runs_read_a_light_models_weights_where_weights_at_says(tmp_path):
    """validate reads an export without its weights; the trial runs that read its dims run
    it from its folder (graph.trials.weights_at), where before they were skipped."""
    from mha_onnx.graph.inputs import input_specs
    from mha_onnx.graph.trials import external, trial, trial_runner, weights_at

    model = _model()
    path = write_model(model, tmp_path / "m.onnx", force=True, external=True)
    light = read_model(path, load_external_data=False)
    assert external(light)  # (no folder said: no trial)
    with weights_at(tmp_path):
        assert not external(light)
        with trial_runner(light) as runner:
            assert trial(runner, input_specs(model), {"n": 3}) == ""
            got = runner.infer(_feeds())
    want = OrtRunner(model.SerializeToString()).infer(_feeds())
    np.testing.assert_array_equal(got["y"], want["y"])
