"""Fused-attention rewrite: onnxscript rules over onnx-ir, no torch.

``fuse_file`` / ``fuse_model`` are the entry points; see :mod:`mha_onnx.rewrite.fuse`.
"""

from __future__ import annotations

from mha_onnx.rewrite.fuse import TARGETS, BlockResult, FuseReport, fuse_file, fuse_model

__all__ = ["TARGETS", "BlockResult", "FuseReport", "fuse_file", "fuse_model"]
