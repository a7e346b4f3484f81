from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from mha_onnx.config import MhaConfig, load_preset
from mha_onnx.errors import ExportError, OutputExistsError
from mha_onnx.export.mha import export_model
from mha_onnx.graph.inputs import ShapeCase, contract_specs, make_inputs
from mha_onnx.reference.mha import build_reference, run_reference
from mha_onnx.runtime.ort import OrtRunner

SMALL = MhaConfig(d_model=32, num_heads=4, name="small")
COMBOS = [(a, m) for a in ("self", "cross") for m in ("none", "key-padding", "causal")]
SHAPES = [(1, 1, 1), (2, 9, 4), (4, 33, 70), (1, 128, 17)]


def feeds_for(cfg: MhaConfig, batch: int, seq_q: int, seq_kv: int, seed: int = 0,
              padding: str = "some") -> dict:
    case = ShapeCase("t", {"batch": batch, "seq_q": seq_q, "seq_kv": seq_kv}, padding)
    return make_inputs(contract_specs(cfg), case, seed=seed)


@pytest.mark.parametrize("attention, mask", COMBOS, ids=[f"{a}-{m}" for a, m in COMBOS])
def test_round_trip_every_attention_and_mask(export_cache, attention, mask):
    cfg = SMALL.replace(attention=attention, mask=mask, d_k=12, d_v=4)
    path = export_cache(cfg)
    model = onnx.load(path)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in list(model.graph.input) + list(model.graph.output)}
    kv = "seq_kv" if attention == "cross" else "seq_q"
    assert dims["query"] == ["batch", "seq_q", 32]
    assert dims["output"] == ["batch", "seq_q", 32]
    if attention == "cross":
        assert dims["key"] == dims["value"] == ["batch", "seq_kv", 32]
    if mask == "key-padding":
        assert dims["key_padding_mask"] == ["batch", kv]
        assert model.graph.input[-1].type.tensor_type.elem_type == onnx.TensorProto.BOOL
    assert len(model.graph.input) == 1 + 2 * (attention == "cross") + (mask == "key-padding")

    module = build_reference(cfg, seed=0)
    with OrtRunner(path) as runner:
        for batch, seq_q, seq_kv in SHAPES:
            feeds = feeds_for(cfg, batch, seq_q, seq_kv, seed=seq_q)
            got = runner.infer(feeds)["output"]
            np.testing.assert_allclose(got, run_reference(module, feeds)["output"], atol=1e-4, rtol=0)


def test_metadata_lets_later_stages_rebuild_the_reference(export_cache):
    cfg = SMALL.replace(mask="causal", bias=False)
    model = onnx.load(export_cache(cfg))
    meta = {p.key: p.value for p in model.metadata_props}
    assert MhaConfig.from_dict(json.loads(meta["mha_onnx.config"])) == cfg
    assert meta["mha_onnx.version"]
    params = json.loads(meta["mha_onnx.params"])
    assert set(params) == {"w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    ref = build_reference(cfg, seed=0).state_dict()
    for name, where in params.items():
        array = inits[where["initializer"]]
        np.testing.assert_array_equal(array.T if where["transposed"] else array, ref[name].numpy())
    assert model.ir_version <= 13


def test_float16_export_runs_in_float16(export_cache):
    cfg = SMALL.replace(dtype="float16", mask="key-padding")
    path = export_cache(cfg)
    module = build_reference(cfg.replace(dtype="float32"), seed=0)
    module.load_state_dict({k: v.half().float() for k, v in module.state_dict().items()})
    feeds = feeds_for(cfg, 2, 19, 19)
    with OrtRunner(path) as runner:
        got = runner.infer(feeds)["output"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), run_reference(module, feeds)["output"], atol=1e-2)


@pytest.mark.slow  # (torch.export)
def test_opset_choice_and_refusal(tmp_path):
    report = export_model(SMALL, tmp_path / "a.onnx", opset=18)
    assert {o.domain: o.version for o in onnx.load(report.path).opset_import}[""] == 18
    with pytest.raises(ExportError, match="opset 12 is not supported"):
        export_model(SMALL, tmp_path / "b.onnx", opset=12)


@pytest.mark.slow  # (torch.export)
def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"precious")
    with pytest.raises(OutputExistsError):
        export_model(SMALL, out)
    assert out.read_bytes() == b"precious"
    report = export_model(SMALL, out, force=True)
    assert report.path == str(out) and report.checks and all(c.passed for c in report.checks)
    assert onnx.load(out).graph.node
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temp files left


@pytest.mark.slow  # (torch.export)
def test_specialised_axis_is_named(tmp_path, monkeypatch):
    """A graph whose seq axis torch fixed to a number must fail, naming the axis."""
    import mha_onnx.export.mha as ex

    real = ex._torch_export

    def fixed(module, config, opset):
        model = real(module, config, opset)
        dim = model.graph.input[0].type.tensor_type.shape.dim[1]
        dim.dim_value = ex.EXAMPLE_SEQ_Q
        return model

    monkeypatch.setattr(ex, "_torch_export", fixed)
    with pytest.raises(ExportError, match="axis 'seq_q'.*specialised"):
        export_model(SMALL, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.slow  # (torch.export)
@pytest.mark.parametrize("mask", ["none", "key-padding", "causal"])
def test_torch_mha_weights_match_torch_under_ort(tmp_path, mask):
    """The issue's bar: nn.MultiheadAttention(512, 8) weights exported with --preset base give
    nn.MultiheadAttention's output under ORT CPU within 1e-4."""
    torch.manual_seed(0)
    torch_mha = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
    torch.save(torch_mha.state_dict(), tmp_path / "sd.pt")
    cfg = load_preset("base").replace(mask=mask)
    path = export_model(cfg, tmp_path / "m.onnx", weights=tmp_path / "sd.pt").path
    with OrtRunner(path) as runner:
        for batch, seq in ((3, 37), (1, 1), (2, 300)):
            x = torch.randn(batch, seq, 512)
            feeds = {"query": x.numpy()}
            kwargs = {}
            if mask == "key-padding":
                padded = torch.zeros(batch, seq, dtype=torch.bool)
                padded[0, seq // 2 + 1 :] = True
                feeds["key_padding_mask"] = padded.numpy()
                kwargs["key_padding_mask"] = padded
            if mask == "causal":
                kwargs["attn_mask"] = torch.ones(seq, seq, dtype=torch.bool).triu(1)
            with torch.no_grad():
                want, _ = torch_mha(x, x, x, need_weights=False, **kwargs)
            np.testing.assert_allclose(runner.infer(feeds)["output"], want.numpy(), atol=1e-4, rtol=0)
