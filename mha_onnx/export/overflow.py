"""A float16 export whose outputs hold inf or NaN, refused with the node that overflows
first (export --model --dtype float16)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mha_onnx.export.options import HfExportConfig


def finite_or_refused(final: Path, validation, cfg: HfExportConfig,
                       progress: Callable[[str], None]) -> None:
    """A float16 export whose outputs hold inf or NaN (where PyTorch in float16 gives them
    alike, validation compared NaN with NaN; where not, it only says they differ) is refused
    with the node that overflows first."""
    broken = sorted({c.output for c in validation.comparisons
                     if c.stats.nan_actual or c.stats.inf_actual})
    if cfg.dtype == "float16" and broken:
        overflow_refused(final, broken, progress)


def overflow_refused(path: Path, broken: list[str], progress: Callable[[str], None]) -> None:
    """Refused with the node that overflows first on generated inputs, where one does (an
    output's -inf that a model writes on purpose, a masked vocabulary's, is no overflow:
    then validation's verdict stands)."""
    from mha_onnx.errors import FusionError
    from mha_onnx.graph.files import read_model
    from mha_onnx.graph.inputs import case_for, input_specs, make_inputs
    from mha_onnx.parity.ranges import activation_ranges

    progress("activation ranges (the float16 outputs hold inf/NaN)")
    model = read_model(path)
    specs = input_specs(model)
    ranges = activation_ranges(str(path), model, [make_inputs(specs, case_for(
        specs, "ranges", 2, [16, 16, 16], "none"))])
    if ranges.overflow is None:
        return
    raise FusionError(f"the float16 export: {', '.join(broken)} hold inf/NaN: "
                      f"{ranges.overflow.said()}; "
                      "nothing was written",
                      hint="export in float32 (--dtype float32); validate --ranges on it names "
                           "the activations near float16's range")
