"""A fused graph keeps the model's opset, and every node the lowering wrote is valid there:
TorchScript's exports (what most BERT files in the world are) sit at opsets 14-17, where
ReduceMin takes its axes as an attribute and Shape has no start/end."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from mha_onnx.errors import EXIT_INTERNAL, FuseBug
from mha_onnx.rewrite.check.verify import verify
from mha_onnx.rewrite.fuse import fuse_model
from mha_onnx.rewrite.tighten.opset_fit import fit_to_opset
from mha_onnx.runtime.ort import OrtRunner


def _torchscript(module: torch.nn.Module, args: tuple, names: list[str], dynamic: dict,
                 opset: int) -> onnx.ModelProto:
    buffer = io.BytesIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, buffer, input_names=names,
                          output_names=["out"], dynamic_axes=dynamic,
                          opset_version=opset, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


class _Bert(torch.nn.Module):
    """A sentence-transformers-like BERT: token ids and a 0/1 attention mask in."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        self.bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64,
                                         vocab_size=100, max_position_embeddings=64))

    def forward(self, ids, mask):
        return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state


class _Encoder(torch.nn.Module):
    """nn.TransformerEncoderLayer with a key padding mask (True = padded)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)

    def forward(self, x, padded):
        return self.layer(x, src_key_padding_mask=padded)


def _bert(opset: int) -> tuple[onnx.ModelProto, dict | None]:
    """Dynamic in batch and length: verified at the generated cases (padded rows among them)."""
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    dims = {0: "batch", 1: "seq"}
    return _torchscript(_Bert(), (ids, mask), ["input_ids", "attention_mask"],
                        {"input_ids": dims, "attention_mask": dims}, opset), None


def _encoder(opset: int) -> tuple[onnx.ModelProto, dict | None]:
    """TorchScript bakes nn.MultiheadAttention's example shape into its Reshapes: verified at
    that shape, one row padded."""
    torch.manual_seed(1)
    x, padded = torch.randn(2, 8, 32), torch.zeros(2, 8, dtype=torch.bool)
    padded[1, 5:] = True
    dims = {0: "batch", 1: "seq"}
    model = _torchscript(_Encoder(), (x, padded), ["x", "padded"],
                         {"x": dims, "padded": dims}, opset)
    return model, {"x": x.numpy(), "padded": padded.numpy()}


@pytest.mark.slow  # (TorchScript's torch.onnx.export: not in the fast suite)
@pytest.mark.parametrize(("make", "opset"), [(_bert, 14), (_bert, 16), (_bert, 17),
                                              (_encoder, 14), (_encoder, 17)],
                         ids=["bert-14", "bert-16", "bert-17", "encoder-14", "encoder-17"])
def test_a_torchscript_export_fuses_at_its_own_opset(make, opset):
    """Every block fused, the opset kept, ORT loads the graph and it agrees with the
    original on padded rows."""
    original, feeds = make(opset)
    fused, blocks, _ = fuse_model(original)
    assert blocks and all(b.status == "fused" for b in blocks), [b.reason for b in blocks]
    assert {o.domain: o.version for o in fused.opset_import}[""] == opset
    onnx.checker.check_model(fused)
    result = verify(original, fused, given=feeds)
    assert result.passed and result.results, result.first_failure()


def _model(nodes, opset: int) -> ir.Model:
    f, i = TensorProto.FLOAT, TensorProto.INT64
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f, ["B", 4, 3])],
        [helper.make_tensor_value_info("low", f, ["B", 3]), helper.make_tensor_value_info("dims", i, [1])],
        initializer=[helper.make_tensor("axes", i, [1], [1])])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                           ir_version=8))


def test_newer_spellings_are_written_in_the_models_opset():
    """ReduceMin(x, axes) -> ReduceMin(x) <axes> below 18; Shape <start, end> -> a Slice of
    the shape below 15 (a graph output keeps its name); the values unchanged."""
    nodes = [helper.make_node("ReduceMin", ["x", "axes"], ["low"], keepdims=0),
             helper.make_node("Shape", ["x"], ["dims"], start=1, end=-1)]
    x = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    want = OrtRunner(ir.to_proto(_model(nodes, 18)).SerializeToString()).infer({"x": x})
    model = _model(nodes, 14)
    assert fit_to_opset(model) == 2
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    got = OrtRunner(proto.SerializeToString()).infer({"x": x})
    for name in ("low", "dims"):
        np.testing.assert_array_equal(got[name], want[name])
    assert fit_to_opset(_model(nodes, 18)) == 0


def test_a_computed_axis_that_cannot_be_spelt_is_fuses_bug():
    nodes = [helper.make_node("Shape", ["x"], ["rank_dims"]),
             helper.make_node("Size", ["rank_dims"], ["rank"]),
             helper.make_node("Sub", ["rank", "one"], ["last"]),
             helper.make_node("Unsqueeze", ["last", "zero"], ["last1"]),
             helper.make_node("ReduceMin", ["x", "last1"], ["low"], keepdims=0),
             helper.make_node("Shape", ["x"], ["dims"])]
    model = _model(nodes, 17)
    for name, value in (("one", 1), ("zero", 0)):
        model.graph.register_initializer(ir.Value(name=name, const_value=ir.tensor(
            np.array(value if name == "one" else [value], np.int64), name=name)))
    with pytest.raises(FuseBug, match="axes are computed") as caught:
        fit_to_opset(model)
    assert caught.value.exit_code == EXIT_INTERNAL
