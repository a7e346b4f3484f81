"""mha-onnx: multi-head attention from PyTorch to production under ONNX Runtime.

Stages (one module each): config -> reference -> export -> rewrite (fuse) -> parity
(validate) -> profile; ``inspect`` summarises any model. Heavy imports (torch, onnxruntime)
happen inside the functions that need them.
"""

from __future__ import annotations

__version__ = "0.1.0"
