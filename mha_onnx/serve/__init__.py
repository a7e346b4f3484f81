"""Serving: ``mha-onnx serve`` (an OpenAI-compatible HTTP server, app.py) over a continuously
batched engine (engine.py, rows.py) that a user may embed without HTTP:

    from mha_onnx.serve import Engine, EngineConfig, Request
    with Engine("model.onnx", EngineConfig(max_batch=8)) as engine:
        tokens = engine.submit(Request(prompt=(1, 2, 3), max_tokens=32)).result().tokens

``mha-onnx serve --replicas N`` runs N replicas behind Ray Serve (ray_serve.py). Triton's
model repository is ``package``'s (mha_onnx.package).
"""

from mha_onnx.serve.config import EngineConfig, Observer
from mha_onnx.serve.engine import Engine
from mha_onnx.serve.requests import Completion, Handle, NotAdmitting, QueueFull, Request

__all__ = ["Completion", "Engine", "EngineConfig", "Handle", "NotAdmitting", "Observer",
           "QueueFull", "Request"]
