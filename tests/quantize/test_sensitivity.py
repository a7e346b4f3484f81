"""Sensitivity in one session: a quantized weight read back from its MatMulNBits is the
weight the kernel multiplies by (every bit width, symmetry and algorithm, a K that is not a
whole number of blocks), and the one-session ranking gives each weight the KL that a model
with that weight alone quantized gives."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mha_onnx.quantize import sensitivity
from mha_onnx.quantize.weights import QuantizeConfig, quantize_weights
from mha_onnx.runtime.ort import OrtRunner
from tests.paths import OPTIMUM

K, N = 80, 24  # K: two and a half blocks of 32


def _matmul(dtype: np.dtype) -> tuple[onnx.ModelProto, np.ndarray]:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((K, N)) * np.linspace(0.1, 3, N)).astype(dtype)
    kind = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "g",
        [helper.make_tensor_value_info("x", kind, [3, K])],
        [helper.make_tensor_value_info("y", kind, [3, N])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model, weight


@pytest.mark.parametrize("config, dtype", [
    (QuantizeConfig(accuracy_level=0), np.float32),
    (QuantizeConfig(accuracy_level=0, symmetric=False), np.float32),
    (QuantizeConfig(weights="int8", accuracy_level=0), np.float32),
    (QuantizeConfig(weights="int8", accuracy_level=0, symmetric=False), np.float32),
    (QuantizeConfig(algorithm="hqq", accuracy_level=0), np.float32),
    (QuantizeConfig(accuracy_level=0, block_size=16, symmetric=False), np.float16),
], ids=["int4", "int4-asym", "int8", "int8-asym", "hqq", "int4-b16-asym-fp16"])
def test_a_weight_read_back_is_what_matmulnbits_multiplies_by(config, dtype):
    model, weight = _matmul(dtype)
    quant = quantize_weights(model, config).model
    assert [n.op_type for n in quant.graph.node] == ["MatMulNBits"]
    back = sensitivity.read_back(quant, ["w"])["w"]
    assert back.shape == (K, N) and back.dtype == dtype
    x = np.random.default_rng(1).standard_normal((3, K)).astype(dtype)
    with OrtRunner(quant.SerializeToString()) as runner:
        got = runner.infer({"x": x})["y"].astype(np.float64)
    want = x.astype(np.float64) @ back.astype(np.float64)
    tolerance = 2e-2 if dtype == np.float16 else 1e-4
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
    error = np.abs(back.astype(np.float64) - weight)  # quantized, and by no more than a step
    assert 0 < error.mean() < 0.1 * np.abs(weight).mean()


@pytest.mark.models
def test_one_session_gives_each_weight_the_kl_of_a_model_with_it_alone_quantized(tmp_path):
    """A fused Llama (a packed Q/K/V weight two If branches share): float compute (accuracy
    level 0), so both ways multiply by the same weights."""
    from mha_onnx.quantize import accuracy
    from mha_onnx.quantize.feeds import decoder_feeds, session_outputs
    from mha_onnx.quantize.run import measure
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.policy import FormPolicy

    path = tmp_path / "model.onnx"
    fuse_file(OPTIMUM / "llama" / "model.onnx", path, policy=FormPolicy(kv_cache="shared"))
    model = onnx.load(path)
    config = QuantizeConfig(accuracy_level=0)
    made = quantize_weights(model, config)
    weights = list(dict.fromkeys(t.weight for t in made.targets if t.bits))
    ranked = measure(model, str(path), made.model, accuracy.Thresholds(), sensitive=weights,
                     config=config).sensitivity
    assert len(ranked) == len(weights) == 11
    feeds, _ = decoder_feeds(model, str(path), accuracy.PROMPTS, accuracy.PROMPT_LENGTH, 0)
    want = session_outputs(str(path), feeds)["logits"]
    every = [t.node for t in made.targets]
    for node, kl in ranked:
        weight = next(t.weight for t in made.targets if t.node == node)
        readers = {t.node for t in made.targets if t.weight == weight}
        alone = quantize_weights(model, QuantizeConfig(
            accuracy_level=0, exclude=tuple(n for n in every if n not in readers))).model
        got = session_outputs(alone, feeds)["logits"]
        assert kl == pytest.approx(float(accuracy.kl_top1(want, got)[0].mean()), rel=1e-3)
    assert ranked[0][1] > ranked[-1][1] > 0


def test_only_the_main_graphs_initializers_become_inputs():
    import onnx_ir as ir

    proto, _ = _matmul(np.float32)
    model = ir.from_proto(proto)
    assert sensitivity.overridable(model, ["w", "w", "absent"]) == ["w"]
    assert sensitivity.overridable(model, ["w"]) == []  # (already an input)
    proto = ir.to_proto(model)
    assert [i.name for i in proto.graph.input] == ["x", "w"]
    assert proto.graph.input[1].type.tensor_type.elem_type == TensorProto.FLOAT
    assert "w" in {t.name for t in proto.graph.initializer}
