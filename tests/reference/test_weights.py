from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

from mha_onnx.config import MhaConfig
from mha_onnx.errors import WeightsError
from mha_onnx.reference.mha import build_reference
from mha_onnx.reference.weights import checksum, load_weights

CFG = MhaConfig(d_model=32, num_heads=4)


def test_safetensors_and_state_dict_of_the_reference(tmp_path):
    state = build_reference(CFG, seed=5).state_dict()
    save_file(dict(state), tmp_path / "w.safetensors")
    torch.save(state, tmp_path / "w.pt")
    for name in ("w.safetensors", "w.pt"):
        loaded = load_weights(tmp_path / name, CFG)
        assert checksum(loaded) == checksum(state)


def test_torch_mha_packed_and_prefixed(tmp_path):
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    torch.save({"layer.self_attn." + k: v for k, v in mha.state_dict().items()}, tmp_path / "p.pt")
    loaded = load_weights(tmp_path / "p.pt", CFG)
    assert torch.equal(loaded["w_k.weight"], mha.in_proj_weight[32:64])
    assert torch.equal(loaded["w_o.bias"], mha.out_proj.bias)


def test_torch_mha_separate_projections(tmp_path):
    mha = torch.nn.MultiheadAttention(32, 4)
    sd = mha.state_dict()
    q, k, v = sd.pop("in_proj_weight").split(32)
    sd.update({"q_proj_weight": q, "k_proj_weight": k, "v_proj_weight": v})
    torch.save(sd, tmp_path / "s.pt")
    assert torch.equal(load_weights(tmp_path / "s.pt", CFG)["w_v.weight"], v)


def test_wrong_shape_names_key_and_both_shapes(tmp_path):
    state = build_reference(MhaConfig(d_model=32, num_heads=4, d_v=4), seed=0).state_dict()
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(WeightsError) as info:
        load_weights(tmp_path / "w.pt", CFG)
    msg = str(info.value)
    assert "'w_v.weight'" in msg and "[16, 32]" in msg and "[32, 32]" in msg


def test_missing_and_unexpected_keys(tmp_path):
    state = dict(build_reference(CFG).state_dict())
    del state["w_k.bias"]
    torch.save(state, tmp_path / "m.pt")
    with pytest.raises(WeightsError, match="lack key 'w_k.bias'"):
        load_weights(tmp_path / "m.pt", CFG)
    state = dict(build_reference(CFG).state_dict(), extra=torch.zeros(2))
    torch.save(state, tmp_path / "u.pt")
    with pytest.raises(WeightsError, match="unexpected key 'extra'"):
        load_weights(tmp_path / "u.pt", CFG)


class _Evil:
    def __reduce__(self):
        return (open, ("/tmp/mha_onnx_pwned", "w"))


def test_pickle_that_runs_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    with path.open("wb") as handle:
        pickle.dump({"w_q.weight": _Evil()}, handle)
    torch.save({"w_q.weight": _Evil()}, tmp_path / "evil2.pt")
    for name in ("evil.pt", "evil2.pt"):
        with pytest.raises(WeightsError) as info:
            load_weights(tmp_path / name, CFG)
        assert "safetensors" in (info.value.hint or "") or "checkpoint" in str(info.value)
    import os
    assert not os.path.exists("/tmp/mha_onnx_pwned")


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all"], ids=["empty", "garbage"])
def test_unreadable_checkpoints(tmp_path, content):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(WeightsError):
        load_weights(path, CFG)
    with pytest.raises(WeightsError, match="not found"):
        load_weights(tmp_path / "nope.pt", CFG)
