"""``validate``: parity of a model across PyTorch, ORT CPU, CUDA and TensorRT.

Parts: :mod:`.config` (what is asked, tolerances), :mod:`.references` (PyTorch rebuilt from an
export's metadata, another ONNX model), :mod:`.run` (the sweep), :mod:`.report`.
"""

from __future__ import annotations

from mha_onnx.parity.config import Tolerance, ValidateConfig, parse_tolerances
from mha_onnx.parity.references import TorchReference
from mha_onnx.parity.report import (
    Comparison,
    MaskedRows,
    ProviderStatus,
    ValidationReport,
)
from mha_onnx.parity.run import validate_model, validation_cases

__all__ = ["Comparison", "MaskedRows", "ProviderStatus", "Tolerance", "TorchReference",
           "ValidateConfig", "ValidationReport", "parse_tolerances", "validate_model",
           "validation_cases"]
