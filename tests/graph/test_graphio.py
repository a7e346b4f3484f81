from __future__ import annotations

import numpy as np
import onnx
import pytest

import mha_onnx.graph.files as graphio
from mha_onnx.errors import ModelFileError, OutputExistsError
from mha_onnx.graph.files import read_model, write_model
from mha_onnx.runtime.ort import OrtRunner


def test_large_models_go_to_external_data_and_come_back(export_cache, tmp_path, monkeypatch):
    from mha_onnx.config import MhaConfig

    model = onnx.load(export_cache(MhaConfig(d_model=32, num_heads=4, name="ext")))
    monkeypatch.setattr(graphio, "EXTERNAL_DATA_THRESHOLD", 1024)  # as if it were > 2 GB
    out = write_model(model, tmp_path / "big.onnx", force=False)
    assert (tmp_path / "big.onnx.data").stat().st_size >= 4 * 32 * 32 * 4  # the four weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    loaded = read_model(out)
    feeds = {"query": np.ones((1, 3, 32), np.float32)}
    want = OrtRunner(model.SerializeToString()).infer(feeds)["output"]
    np.testing.assert_array_equal(OrtRunner(str(out)).infer(feeds)["output"], want)
    assert len(loaded.graph.initializer) == len(model.graph.initializer)
    with pytest.raises(OutputExistsError):
        write_model(model, tmp_path / "big.onnx", force=False)


def test_missing_external_file_is_named(export_cache, tmp_path, monkeypatch):
    from mha_onnx.config import MhaConfig

    model = onnx.load(export_cache(MhaConfig(d_model=32, num_heads=4, name="ext")))
    monkeypatch.setattr(graphio, "EXTERNAL_DATA_THRESHOLD", 1024)
    write_model(model, tmp_path / "m.onnx", force=False)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(ModelFileError, match="not found beside the model"):
        read_model(tmp_path / "m.onnx")
