"""runtime/: what each runtime can do on a provider, read instead of asking which runtime it
is (validate and profile branch on these, not on provider names)."""

from __future__ import annotations

from mha_onnx.runtime import capabilities, make_runner
from mha_onnx.runtime.openvino import OpenVinoRunner
from mha_onnx.runtime.ort import OrtRunner


def test_each_runtime_says_what_it_can_do():
    cpu, cuda = capabilities("cpu"), capabilities("cuda")
    assert (cpu.runtime, cpu.label, cpu.device) == ("onnxruntime", "ort cpu", "CPU")
    assert cpu.child_preflight and cpu.op_profile and not cpu.places_nodes_on_cpu
    assert cuda.device == "CUDA" and cuda.places_nodes_on_cpu and cuda.label == "ort cuda"
    ov, gpu = capabilities("openvino"), capabilities("openvino:GPU")
    assert (ov.runtime, ov.label, ov.device, gpu.device) == ("openvino", "openvino", "CPU", "GPU")
    assert not (ov.child_preflight or ov.op_profile or ov.places_nodes_on_cpu)


def test_the_runner_made_for_a_provider_is_the_one_whose_capabilities_are_read():
    assert isinstance(make_runner(b"", "cpu"), OrtRunner)  # (no session until used)
    assert isinstance(make_runner(b"", "openvino"), OpenVinoRunner)
    assert capabilities("openvino") == OpenVinoRunner.capabilities("openvino")
