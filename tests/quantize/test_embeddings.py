"""--embeddings int4|int8 (mha_onnx/quantize/embeddings.py): the token embedding's Gather
onto ONNX Runtime's GatherBlockQuantized. ORT's kernel reads back the table our codes mean
(packing and zero point as its contract says), only the Gather of input_ids is touched, and
on the trained fixture the file drops the float table and still passes the gate."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

from mha_onnx.cli import main
from mha_onnx.graph.walk import all_nodes
from mha_onnx.quantize.embeddings import dequantize_table, quantize_embeddings, quantize_table
from mha_onnx.runtime.ort import OrtRunner
from tests.paths import ROOT

TRAINED = ROOT / "tests" / "fixtures" / "trained" / "llama-onnx" / "model.onnx"


def _two_tables() -> tuple[onnx.ModelProto, np.ndarray]:
    """embedded = Gather(table, input_ids), angle = Gather(cos, position_ids)."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    cos = rng.standard_normal((32, 64)).astype(np.float32)
    ints = [helper.make_tensor_value_info(n, onnx.TensorProto.INT64, ["b", "s"])
            for n in ("input_ids", "position_ids")]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["embedded"], name="embed"),
         helper.make_node("Gather", ["cos", "position_ids"], ["angle"], name="rotary")], "g",
        ints, [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["b", "s", 64])
               for n in ("embedded", "angle")],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(cos, "cos")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model, table


@pytest.mark.parametrize("bits", [4, 8])
def test_ort_reads_back_the_table_the_codes_mean(bits):
    model, table = _two_tables()
    for node in model.graph.node:  # (unnamed: the new node's name comes from its output)
        node.name = ""
    quantized, notes = quantize_embeddings(model, bits, 32)
    ops = [n.op_type for n in quantized.graph.node]
    assert ops == ["GatherBlockQuantized", "Gather"], ops  # the rotary table left alone
    assert f"int{bits}" in notes[0]
    codes, scales = quantize_table(table, bits, 32)
    back = dequantize_table(codes, scales, bits, 32)
    step = np.repeat(scales, 32, axis=1)
    assert np.all(np.abs(back - table) <= step / 2 + 1e-6)  # round to nearest
    ids = np.array([[0, 7, 49], [3, 3, 1]], np.int64)
    with OrtRunner(quantized.SerializeToString()) as runner:
        got = runner.infer({"input_ids": ids, "position_ids": ids % 32})
    np.testing.assert_allclose(got["embedded"], back[ids], rtol=1e-6, atol=1e-6)


def test_the_trained_fixture_drops_its_float_table(tmp_path):
    sizes = {}
    for embeddings in ("float", "int8"):
        out = tmp_path / f"{embeddings}.onnx"
        result = CliRunner().invoke(main, ["quantize", str(TRAINED), "-o", str(out),
                                           "--embeddings", embeddings, "--no-sensitivity",
                                           "--json"])
        assert result.exit_code == 0, result.output
        sizes[embeddings] = json.loads(result.output)["bytes"]["quantized"]
    model = onnx.load(tmp_path / "int8.onnx")
    ops = [n.op_type for n in all_nodes(model.graph)]
    assert "GatherBlockQuantized" in ops and "Gather" not in ops
    assert sizes["int8"] < sizes["float"] - 700_000  # the 1 MB float table gone
