"""A stand-in for `tritonclient.http` and a Triton server with the onnxruntime backend, as
their documentation describes them, to run the README's requests against a packaged
repository where no `tritonserver` can be installed (tools/serve_check.py runs a real one).

What it holds a repository to, as Triton would: the config parses with Triton's schema; the
model's inputs are the config's inputs plus its states (the backend's count check); a
request names configured inputs only, with their data types, the batch dim first (max batch
size > 0) and the configured dims; a sequence's first request gets the zero initial state
(with the batch dim), each later one the state the previous request returned.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
from google.protobuf import text_format

TRITON_NUMPY = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "FP16": np.float16,
                "BOOL": np.bool_}


class Server:
    def __init__(self, repository: Path, name: str, pb2) -> None:
        folder = Path(repository) / name
        self.config = text_format.Parse((folder / "config.pbtxt").read_text(), pb2.ModelConfig())
        self.pb2 = pb2
        self.session = ort.InferenceSession(str(folder / "1" / "model.onnx"))
        states = list(self.config.sequence_batching.state)
        model_inputs = {i.name for i in self.session.get_inputs()}
        configured = {i.name for i in self.config.input} | {s.input_name for s in states}
        assert model_inputs == configured, (model_inputs, configured)
        self.states = states
        self.held: dict[int, dict[str, np.ndarray]] = {}

    def infer(self, inputs, sequence_id: int = 0, sequence_start: bool = False,
              sequence_end: bool = False):
        batched = self.config.max_batch_size > 0
        feeds = {}
        configured = {i.name: i for i in self.config.input}
        for item in inputs:
            spec = configured[item.name]  # (KeyError: an input the config does not have)
            dtype = self.pb2.DataType.Name(spec.data_type).removeprefix("TYPE_")
            assert item.datatype == dtype, (item.name, item.datatype, dtype)
            shape = list(item.array.shape)
            assert shape == list(item.shape)
            dims = shape[1:] if batched else shape
            if batched:
                assert 1 <= shape[0] <= self.config.max_batch_size
            assert len(dims) == len(spec.dims) and all(
                d == -1 or d == n for d, n in zip(spec.dims, dims, strict=True)), (item.name, dims)
            feeds[item.name] = item.array
        if self.states:
            assert sequence_id, "a stateful model needs a sequence_id"
            if sequence_start:
                self.held[sequence_id] = {
                    s.input_name: np.zeros(([1] if batched else []) + list(
                        s.initial_state[0].dims), TRITON_NUMPY[self.pb2.DataType.Name(
                            s.data_type).removeprefix("TYPE_")]) for s in self.states}
            feeds.update(self.held[sequence_id])
        names = [o.name for o in self.session.get_outputs()]
        values = dict(zip(names, self.session.run(None, feeds), strict=True))
        if self.states:
            self.held[sequence_id] = {s.input_name: values[s.output_name] for s in self.states}
            if sequence_end:
                del self.held[sequence_id]
        return types.SimpleNamespace(
            as_numpy=lambda name: values[name] if name in {o.name for o in self.config.output}
            else None)


def http_module(server: Server) -> types.ModuleType:
    """A `tritonclient.http` whose client sends to ``server``."""
    module = types.ModuleType("tritonclient.http")

    class InferInput:
        def __init__(self, name: str, shape: list[int], datatype: str) -> None:
            self.name, self.shape, self.datatype, self.array = name, shape, datatype, None

        def set_data_from_numpy(self, array: np.ndarray) -> None:
            self.array = array

    class InferenceServerClient:
        def __init__(self, url: str) -> None:
            self.url = url

        def infer(self, model_name: str, inputs, **sequence):
            assert model_name == server.config.name
            return server.infer(inputs, **sequence)

    module.InferInput = InferInput
    module.InferenceServerClient = InferenceServerClient
    return module


def run_readme(readme: Path, server: Server) -> dict:
    """Execute the README's Python request with the stand-in client; its globals after."""
    text = readme.read_text()
    code = text[text.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    package = types.ModuleType("tritonclient")
    package.http = http_module(server)
    import sys

    saved = {k: sys.modules.get(k) for k in ("tritonclient", "tritonclient.http")}
    sys.modules["tritonclient"], sys.modules["tritonclient.http"] = package, package.http
    try:
        scope: dict = {}
        exec(compile(code, str(readme), "exec"), scope)  # noqa: S102 - our own README
        return scope
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
