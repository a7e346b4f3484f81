"""Fused-attention rewrite: onnxscript rules over onnx-ir, no torch.

``fuse_file`` / ``fuse_model`` are the entry points (:mod:`mha_onnx.rewrite.fuse`), what they
may choose is :class:`mha_onnx.rewrite.policy.FormPolicy`. The entry points load on first use,
so that the CLI reads the policy's choices without importing the rewrite.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BlockResult", "FormPolicy", "FuseReport", "fuse_file", "fuse_model"]


def __getattr__(name: str) -> Any:
    if name == "FormPolicy":
        from mha_onnx.rewrite.policy import FormPolicy

        return FormPolicy
    if name in __all__:
        from mha_onnx.rewrite import fuse

        return getattr(fuse, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
