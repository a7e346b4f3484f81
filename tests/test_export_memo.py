"""The suite's remembered exports (tests/export_memo.py) are what a fresh export gives, byte
for byte, and a model whose weights, options or exporting code change is exported afresh."""

from __future__ import annotations

import numpy as np
import pytest

from tests import export_memo

pytestmark = pytest.mark.models


def test_a_remembered_export_is_the_fresh_one_byte_for_byte(tmp_path):
    import mha_onnx.export.mha as mha
    import tests.models as models
    from mha_onnx.config import MhaConfig
    from mha_onnx.export.mha import export_model
    from tests.models import ZOO

    zoo = ZOO["sdpa18_key_padding"]()  # through the session's memo (conftest)
    with pytest.MonkeyPatch.context() as patch:  # the functions as they are, no memo
        patch.setattr(models, "export", models.export.original)
        patch.setattr(mha, "_torch_export", mha._torch_export.original)
        fresh_zoo = ZOO["sdpa18_key_padding"]()
        config = MhaConfig(d_model=32, num_heads=4, mask="key-padding")
        export_model(config, tmp_path / "fresh.onnx")
    assert zoo.SerializeToString() == fresh_zoo.SerializeToString()
    export_model(config, tmp_path / "memo.onnx")  # (first call: exported, then remembered)
    export_model(config, tmp_path / "again.onnx")  # remembered
    fresh, again = (tmp_path / "fresh.onnx").read_bytes(), (tmp_path / "again.onnx").read_bytes()
    assert fresh == again


def test_the_key_follows_the_weights_the_attributes_the_options_and_the_code():
    import torch

    from tests.models import TorchMha

    torch.manual_seed(0)
    module = TorchMha(True, "self")
    args = (torch.zeros(2, 3, 32),)
    code = export_memo._code("zoo")
    first = export_memo.key(module, args, {"opset": 18}, code)
    assert first == export_memo.key(module, args, {"opset": 18}, code)  # (no addresses in it)
    assert first != export_memo.key(module, args, {"opset": 17}, code)
    assert first != export_memo.key(module, (torch.ones(2, 3, 32),), {"opset": 18}, code)
    assert first != export_memo.key(module, args, {"opset": 18}, np.random.bytes(8))
    module.mode = "causal"  # (an attribute its forward reads)
    assert export_memo.key(module, args, {"opset": 18}, code) != first
    module.mode = "self"
    with torch.no_grad():
        next(module.parameters()).add_(1e-6)
    assert export_memo.key(module, args, {"opset": 18}, code) != first
