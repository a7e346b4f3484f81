from __future__ import annotations

import pytest

from mha_onnx.config import MhaConfig, graph_inputs, load_config_file, load_preset, preset_names
from mha_onnx.errors import ConfigError


def test_presets_match_the_paper():
    base, big = load_preset("base"), load_preset("big")
    assert (base.d_model, base.num_heads, base.d_k, base.d_v) == (512, 8, 64, 64)
    assert (big.d_model, big.num_heads, big.d_k, big.d_v) == (1024, 16, 64, 64)
    assert {"base", "big"} <= set(preset_names())
    # 4 d_model^2 weights per layer (the seed's count) plus the biases
    assert base.parameter_count == 4 * 512**2 + 4 * 512


def test_head_dims_default_and_explicit():
    cfg = MhaConfig(d_model=96, num_heads=3, d_k=16, d_v=40)
    assert (cfg.qk_dim, cfg.v_dim) == (48, 120)
    assert MhaConfig(d_model=96, num_heads=3).d_k == 32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"d_model": 500, "num_heads": 8}, "not divisible"),
        ({"d_model": 0}, "d_model must be positive"),
        ({"num_heads": -2}, "num_heads must be positive"),
        ({"d_k": -1}, "d_k must be positive"),
        ({"mask": "diagonal"}, "mask must be one of"),
        ({"attention": "both"}, "attention must be one of"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"d_model": 51.2}, "d_model must be an integer"),
    ],
    ids=["indivisible", "zero-dmodel", "negative-heads", "negative-dk", "mask", "attention",
         "dtype", "float-dim"],
)
def test_impossible_configs_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MhaConfig(**kwargs)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError) as info:
        load_preset("huge")
    assert "base" in info.value.hint and "big" in info.value.hint


def test_config_file_round_trip(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('d_model = 64\nnum_heads = 2\nd_v = 16\nmask = "causal"\n')
    cfg = load_config_file(path)
    assert (cfg.d_model, cfg.d_k, cfg.d_v, cfg.mask, cfg.name) == (64, 32, 16, "causal", "mine")
    assert MhaConfig.from_dict(cfg.to_dict()) == cfg
    path.write_text("d_model = 64\nheads = 2\n")
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config_file(path)


def test_graph_contract_inputs():
    names = lambda cfg: [(s.name, s.dims) for s in graph_inputs(cfg)]  # noqa: E731
    assert names(MhaConfig()) == [("query", ("batch", "seq_q", 512))]
    assert names(MhaConfig(attention="cross", mask="key-padding")) == [
        ("query", ("batch", "seq_q", 512)),
        ("key", ("batch", "seq_kv", 512)),
        ("value", ("batch", "seq_kv", 512)),
        ("key_padding_mask", ("batch", "seq_kv")),
    ]
    assert names(MhaConfig(mask="key-padding"))[-1] == ("key_padding_mask", ("batch", "seq_q"))
