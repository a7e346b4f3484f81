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
from mha_onnx.graph.inputs import input_specs
from tests.irgraphs import F, model, node, tensor


def _llama(tmp_path, cached: bool):
    """A one-layer HF Llama through torch.export with Dim.DYNAMIC on every axis."""
    import torch
    import transformers as tf

    from tests.models import CachedWrap, HfWrap

    config = tf.LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            max_position_embeddings=128)
    torch.manual_seed(0)
    llama = tf.LlamaModel(config).eval()
    dyn = torch.export.Dim.DYNAMIC
    ids = torch.randint(0, 99, (2, 3))
    if cached:
        module = CachedWrap(llama)
        args = (ids, torch.ones(2, 8, dtype=torch.int64), torch.randn(2, 2, 5, 8),
                torch.randn(2, 2, 5, 8))
        shapes = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 2: dyn}, {0: dyn, 2: dyn})
        names = ["input_ids", "attention_mask", "past_key", "past_value"]
        outputs = ["out", "present_key", "present_value"]
    else:
        module = HfWrap(llama, ["input_ids", "attention_mask"], "last_hidden_state")
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


def _samples_encoder(kernels=(10, 3), strides=(5, 2)):
    """x [batch, samples] -> Unsqueeze -> strided 1-D Convs (a speech encoder's front)."""
    import numpy as np
    from onnx import numpy_helper

    nodes = [node("Unsqueeze", ["x", "axis1"], "c0")]
    weights = [numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    for n, (k, s) in enumerate(zip(kernels, strides, strict=True)):
        weights.append(numpy_helper.from_array(np.full((1, 1, k), 0.1, np.float32), f"w{n}"))
        nodes.append(node("Conv", [f"c{n}", f"w{n}"], f"c{n + 1}", strides=[s]))
    graph = onnx.helper.make_graph(nodes, "g", [tensor("x", F, ["batch", "samples"])],
                                   [onnx.ValueInfoProto(name=f"c{len(kernels)}")], weights)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)],
                                  ir_version=9)


def test_lengths_below_a_convolution_stacks_receptive_field_are_lifted():
    """Kernels 10, 3 with strides 5, 2 need 20 samples: found by trial, and every generated
    length is lifted above it (distinct lengths stay distinct)."""
    from mha_onnx.graph.inputs import default_cases

    specs = input_specs(_samples_encoder())
    assert [s.floors for s in specs] == [(("samples", 20),)]
    lengths = [case.dims["samples"] for case in default_cases(specs)]
    assert lengths == [20, 13 + 19, 40] and all(n >= 20 for n in lengths)
    assert input_specs(_samples_encoder(kernels=(1, 1), strides=(1, 1)))[0].floors == ()


def test_shapes_below_the_floor_are_refused_in_one_line():
    from mha_onnx.errors import InputSpecError
    from mha_onnx.graph.inputs import parse_shapes

    specs = input_specs(_samples_encoder())
    assert parse_shapes("2:20", specs)[0].dims == {"batch": 2, "samples": 20}
    with pytest.raises(InputSpecError, match=r"samples >= 20"):
        parse_shapes("1:5", specs)


def test_a_mask_over_raw_samples_keeps_the_floor_in_every_row():
    """A HuBERT file with its attention mask over the raw samples (torch.onnx.export,
    tests/fixtures/audio/make.py): a row keeping fewer samples than the conv stack needs
    gets a negative length from the model (ScatterND "invalid indice -2" in ORT). Every
    generated row keeps the floor (20 samples), at every padding, so validate runs at the
    least size; a fully padded row keeps it too."""
    import numpy as np

    from mha_onnx.graph.inputs import ShapeCase, make_inputs
    from tests.paths import ROOT

    path = ROOT / "tests" / "fixtures" / "audio" / "hubert-mask.onnx"
    specs = input_specs(onnx.load(path))
    assert dict(specs[1].floors) == {"samples": 20}
    for padding in ("some", "left", "full", "tail"):
        case = ShapeCase("least", {"batch": 5, "samples": 20}, padding, pad_fraction=0.5)
        mask = make_inputs(specs, case)["attention_mask"]
        assert (mask.sum(-1) == 20).all(), padding
        longer = make_inputs(specs, ShapeCase("x", {"batch": 5, "samples": 33}, padding,
                                              pad_fraction=0.5))["attention_mask"]
        assert (longer.sum(-1) >= 20).all() and (longer.sum(-1) < 33).any(), padding
        if padding == "left":
            assert np.array_equal(longer[:, -20:], np.ones((5, 20), longer.dtype))
    result = CliRunner().invoke(main, ["validate", str(path), "--reference", str(path),
                                       "--shapes", "3:20,3:24"])
    assert result.exit_code == 0 and "PASSED" in result.output, result.output


def test_input_lengths_at_which_computed_keys_cross_a_switch():
    from mha_onnx.rewrite.check.cases import input_length

    assert input_length("((sequence_length//10)) - 1", 1025) == ("sequence_length", 10260)
    assert input_length("2*x", 7) == ("x", 4)
    assert input_length("past + seq", 5) is None  # two input dims: not one answer
    assert input_length("x - 100000000", 3) is None  # never within the limit
    assert input_length("frames (unknown)", 3) is None  # not an expression


def test_verification_runs_where_computed_keys_cross_each_switch():
    """A speech encoder's keys are frames (samples // 10 - 1): the cases past a form's length
    switches are in samples that give that many frames, not that many samples."""
    from types import SimpleNamespace

    from mha_onnx.rewrite.check.cases import verification_cases
    from mha_onnx.rewrite.forms import Form, either

    form = either("T < 128", "MHA key_padding_mask", Form("Loop"), switch_at=(128,))
    form = Form(form.kernel, form.guard, form.otherwise, form.switch_at, keys="samples // 10 - 1")
    cases = verification_cases(_samples_encoder(), [SimpleNamespace(chosen=form)])
    past = [c for c in cases if c.label.startswith("past a form threshold")]
    assert [c.dims["samples"] for c in past] == [1290] and all(c.optional for c in past)
