"""Dims the graph relates but the exporter named apart (torch.export's Dim.DYNAMIC): inputs
generated at one size per axis, the graph fused as if named alike; where nothing relates
them, a one-line error naming the dims and --shapes / --inputs."""

from __future__ import annotations

import json
import warnings

import onnx
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.inputs import input_specs
from tests.irgraphs import F, model, node, tensor


def _llama(tmp_path, cached: bool):
    """A one-layer HF Llama through torch.export with Dim.DYNAMIC on every axis."""
    import torch
    import transformers as tf

    from tools.zoo import _CachedWrap, _HfWrap

    config = tf.LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            max_position_embeddings=128)
    torch.manual_seed(0)
    llama = tf.LlamaModel(config).eval()
    dyn = torch.export.Dim.DYNAMIC
    ids = torch.randint(0, 99, (2, 3))
    if cached:
        module = _CachedWrap(llama)
        args = (ids, torch.ones(2, 8, dtype=torch.int64), torch.randn(2, 2, 5, 8),
                torch.randn(2, 2, 5, 8))
        shapes = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 2: dyn}, {0: dyn, 2: dyn})
        names = ["input_ids", "attention_mask", "past_key", "past_value"]
        outputs = ["out", "present_key", "present_value"]
    else:
        module = _HfWrap(llama, ["input_ids", "attention_mask"], "last_hidden_state")
        args = (ids, torch.ones(2, 3, dtype=torch.int64))
        shapes = {"args": ({0: dyn, 1: dyn}, {0: dyn, 1: dyn})}
        names, outputs = ["input_ids", "attention_mask"], ["out"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=shapes,
                                    input_names=names, output_names=outputs, opset_version=18)
    path = tmp_path / ("cached.onnx" if cached else "plain.onnx")
    program.save(str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "kv-cache"])
def test_a_dim_dynamic_export_fuses_with_its_axes_related(tmp_path, cached):
    src = _llama(tmp_path, cached)
    raw = [[d.dim_param for d in i.type.tensor_type.shape.dim[:2]] for i in
           onnx.load(src).graph.input[:2]]
    assert raw[0][0] != raw[1][0]  # the exporter named the batch twice
    specs = {s.name: s.dims for s in input_specs(onnx.load(src))}
    assert specs["input_ids"][0] == specs["attention_mask"][0]
    if cached:  # the mask spans the past and the new tokens
        assert specs["attention_mask"][1] == f"{specs['past_key'][2]} + {specs['input_ids'][1]}"
    result = CliRunner().invoke(main, ["fuse", str(src), "-o", str(tmp_path / "f.onnx"),
                                       "--json"])
    assert result.exit_code == 0, result.output
    (block,) = json.loads(result.output)["blocks"]
    assert block["status"] == "fused" and "GroupQueryAttention" in block["form"], block


def test_dims_nothing_relates_are_named_in_one_line(tmp_path):
    """x [A, 3] + y [B, 5] runs at no sizes: the error names the dims and the options."""
    proto = model([node("Add", ["x", "y"], "z")],
                  [tensor("x", F, ["a", "m"]), tensor("y", F, ["b", "n"])], ["z"],
                  out_types={"z": (F, ["a", "m"])})
    path = tmp_path / "bad.onnx"
    onnx.save(proto, path)
    result = CliRunner().invoke(main, ["fuse", str(path), "-o", str(tmp_path / "o.onnx")])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert "['a', 'b', 'm', 'n']" in line and "--shapes" in line and "--inputs" in line
