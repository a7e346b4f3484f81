"""One trial run of a graph at given sizes of its symbolic dims (dims.py, images.py): whether
ORT runs it there, and what length a watched output comes out with."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import numpy as np
import onnx


def trial(runner, specs: Sequence, sizes: dict) -> str:
    """One trial run at ``sizes`` (see _trial_array): '' when the graph ran, else why not."""
    return counted_trial(runner, specs, sizes, None)[0]


def counted_trial(runner, specs: Sequence, sizes: dict, axis: int | None
                   ) -> tuple[str, int | None]:
    """``_trial`` and the last output's length along ``axis`` (where one is given and ran)."""
    try:
        outputs = runner.infer({s.name: trial_array(s, sizes) for s in specs})
    except Exception as exc:  # noqa: BLE001 - sizes the graph does not take
        return str(exc) or type(exc).__name__, None
    last = list(outputs.values())[-1] if axis is not None else None
    if last is None or last.ndim < (axis + 1 if axis >= 0 else -axis):
        return "", None
    return "", int(last.shape[axis])


_WEIGHTS_AT: ContextVar[Path | None] = ContextVar("mha_onnx_weights_at", default=None)


@contextlib.contextmanager
def weights_at(folder: Path) -> Iterator[None]:
    """Within it, a model whose weights are external data has them in ``folder`` (a model
    read from a file there without them: validate's), so trial runs read them there."""
    token = _WEIGHTS_AT.set(Path(folder))
    try:
        yield
    finally:
        _WEIGHTS_AT.reset(token)


def _outside(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def external(model: onnx.ModelProto) -> bool:
    """Weights in external files no trial run can read (no :func:`weights_at` says where):
    then no trial run."""
    return _outside(model) and _WEIGHTS_AT.get() is None


@contextlib.contextmanager
def trial_runner(model: onnx.ModelProto) -> Iterator[Any]:
    """A CPU session of ``model`` for trial runs that packs no weight: its weights read in
    place, from the folder :func:`weights_at` names, or from a scratch file (a session from
    the model's bytes would hold them twice more)."""
    from mha_onnx.graph.copies import scratch_file
    from mha_onnx.runtime.ort import OrtRunner

    folder = _WEIGHTS_AT.get()
    if folder is not None and _outside(model):
        with OrtRunner(model.SerializeToString(), "cpu", optimization="basic",
                       prepacking=False, external_data_dir=folder) as runner:
            yield runner
        return
    with scratch_file(model) as path, OrtRunner(path, "cpu", optimization="basic",
                                                 prepacking=False) as runner:
        yield runner


def trial_size(dim: str, sizes: dict) -> int:
    """A symbolic dim's trial size: ``a + b`` summed, an unknown name 1."""
    return sum(sizes.get(term.strip(), 1) for term in dim.split("+"))


def trial_array(spec, sizes: dict) -> np.ndarray:
    """An input for one trial run: other symbolic dims 1, integers 1 (a kept token of id
    1), booleans False (nothing padded), floats random."""
    shape = [d if isinstance(d, int) else trial_size(d, sizes) for d in spec.dims]
    if spec.dtype.kind in "iu":
        return np.ones(shape, dtype=spec.dtype)
    if spec.dtype == np.bool_:
        return np.zeros(shape, dtype=bool)
    return np.random.default_rng(0).standard_normal(shape).astype(spec.dtype)
