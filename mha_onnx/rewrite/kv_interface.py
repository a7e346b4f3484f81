"""The KV-cache interface of a fused model, as fuse reports and records it: the pasts'
length dim in the original, and the note on a shared cache (or why a model cannot share)."""

from __future__ import annotations

import onnx

from mha_onnx.errors import ConfigError
from mha_onnx.graph.cache import LENGTH_INPUT, MAX_LENGTH
from mha_onnx.rewrite.forms import ONE_TOKEN, SHARED, Form


def past_dim(model: onnx.ModelProto, pairs: dict[str, str]) -> str:
    """The name of the pasts' length dim in the original (``past_seq``, ``past``, ...)."""
    for value in model.graph.input:
        if value.name in pairs and len(value.type.tensor_type.shape.dim) == 4:
            return value.type.tensor_type.shape.dim[2].dim_param or LENGTH_INPUT
    return LENGTH_INPUT


def shared_note(shared: int, chosen: dict[str, Form], rows, from_shapes: bool) -> str:
    """Refuses a shared cache that is not every cached layer's; the note on the interface."""
    appended = [block for block, form in chosen.items()
                if ONE_TOKEN in form.all_cases() and SHARED not in form.all_cases()]
    if appended or not shared:
        raise ConfigError(
            "--kv-cache shared: " + (f"{len(appended)} cached layer(s) cannot take a shared "
                                     f"buffer (their caches are not plain model inputs and "
                                     f"outputs, they add a position bias or attention sinks, "
                                     f"which the shared forms do not, or V's head size is not "
                                     f"K's, which no kernel with past takes): "
                                     f"{', '.join(appended)}" if appended else
                                     "the model has no KV-cache attention a shared buffer "
                                     "can take (a past input appended to and returned as a "
                                     "present, K and V of one head size)"),
            hint="fuse without --kv-cache shared keeps the appended cache")
    head = (f"KV cache shared by {shared} layer(s): every past_* input is now a buffer of "
            f"{MAX_LENGTH} positions; the cached length is "
            + (f"{rows.input}.shape[1] minus the new tokens (ONNX Runtime GenAI's "
               "past_present_share_buffer contract)" if from_shapes else
               f"{LENGTH_INPUT} (a new int64 input)"))
    layout = (f"; per-row lengths: row b holds the keys {rows.input!r} keeps first (as many as "
              "it keeps), and a step writes after them, so left- or right-padded batches stay "
              "on GroupQueryAttention" if rows is not None else
              f"; its first {LENGTH_INPUT} positions are cached, the same for every row")
    return (head + layout + "; bind each past and its present to the same buffer (IO "
            "binding) to update it in place")
