"""A float16 export with an activation past float16's range, refused with the node that
overflows first and the module to keep in float32 (export --model --dtype float16)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mha_onnx.export.options import HfExportConfig


def finite_or_refused(exported: Path, validation, cfg: HfExportConfig,
                       progress: Callable[[str], None], scope: str = "") -> None:
    """A float16 export with an activation past float16's range is refused with the node
    that overflows first in ``exported``, torch.export's file before fusion (its nodes are
    the modules' own; its cache interface is the appended one whatever the fused form). Where its outputs hold inf or NaN (where PyTorch in float16 gives
    them alike, validation compared NaN with NaN; where not, it only says they differ), and
    where they do not: ORT's CPU provider computes many float16 operators in float32, so
    outputs finite here can be inf on a GPU (parity/ranges.py). ``scope``: the exported
    part's module name in the whole model (an encoder-decoder's encoder), before the names
    torch.export recorded, so that the module said is one --keep-float32 takes."""
    if cfg.dtype != "float16":
        return
    broken = sorted({c.output for c in validation.comparisons
                     if c.stats.nan_actual or c.stats.inf_actual})
    overflow_refused(exported, broken, progress, scope)


def overflow_refused(path: Path, broken: list[str], progress: Callable[[str], None],
                     scope: str = "") -> None:
    """Refused with the node that overflows first on generated inputs, where one does (an
    output's -inf that a model writes on purpose, a masked vocabulary's, is no overflow:
    then validation's verdict stands). ``broken``: the outputs holding inf/NaN, if any."""
    from mha_onnx.errors import FusionError
    from mha_onnx.graph.files import read_model
    from mha_onnx.graph.inputs import case_for, input_specs, make_inputs
    from mha_onnx.parity.ranges import activation_ranges

    progress("activation ranges against float16's" + (" (the float16 outputs hold inf/NaN)"
                                                       if broken else ""))
    model = read_model(path)
    specs = input_specs(model)
    ranges = activation_ranges(str(path), model, [make_inputs(specs, case_for(
        specs, "ranges", 2, [16, 16, 16], "none"))])
    if ranges.overflow is None:
        return
    overflow = ranges.overflow.under(scope)
    where = (f"{', '.join(broken)} hold inf/NaN" if broken else
             "outputs finite on ORT's CPU provider (it computes float16 operators in float32), "
             "inf where float16 kernels run (a GPU)")
    module = overflow.module
    raise FusionError(f"the float16 export: {where}: {overflow.said()}; "
                      "nothing was written",
                      hint=("--keep-float32 as said, or " if module else "")
                      + "export in float32 (--dtype float32); validate --ranges on it names "
                        "every activation near float16's range")
