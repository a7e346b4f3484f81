"""Model files copied or made for a moment without one more copy of the weights in memory:
a scratch file for a session (its weights mapped in place), a written model moved to its
output (its weights copied from file to file)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx

from mha_onnx.graph import files
from mha_onnx.graph.files import (
    atomic_path,
    external_files,
    read_model,
    write_bytes,
    write_model,
)
from mha_onnx.graph.light import outside_main, write_inline


@contextlib.contextmanager
def scratch_file(model: onnx.ModelProto) -> Iterator[Path]:
    """``model`` as a file in a scratch folder, its weights external data beside it (which
    ONNX Runtime maps in place: a session from the model's bytes holds them twice more)."""
    with tempfile.TemporaryDirectory(prefix="mha_onnx_model_") as folder:
        yield write_model(model, Path(folder) / "model.onnx", force=True, external=True)


def copy_model(source: Path, target: Path) -> Path:
    """``source`` written to ``target`` (replaced) as write_model writes a model: a scratch
    file whose weights are external data keeps them there where write_model would (one file
    of them copied to ``<target name>.data`` beside it), else they are written into it; the
    weights are copied from file to file, never held."""
    model = read_model(source, load_external_data=False)
    found = external_files(model, source)
    if not found:
        shutil.copyfile(source, target)
        return target
    if outside_main(model):  # (a branch's weights outside: read in whole)
        return write_model(read_model(source), target, force=True)
    if len(found) > 1 or found[0].stat().st_size < files.EXTERNAL_DATA_THRESHOLD:
        with atomic_path(target, force=True) as tmp, tmp.open("wb") as handle:
            write_inline(model, source.parent, handle)
        return target
    data = target.with_name(target.name + ".data")
    shutil.copyfile(found[0], data)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = data.name
    return write_bytes(model.SerializeToString(), target, force=True)
