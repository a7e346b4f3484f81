"""Safe reading and writing of ONNX files.

Reading refuses what is not a model (missing, empty, a folder, corrupt protobuf) with one clear
error, and external data that would be read from outside the model's own folder. Writing is
atomic (temp file in the same folder, fsync, rename), never replaces a file without ``force``
and moves tensors to external data beside the model when the file would pass protobuf's 2 GB.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.json_format import ParseError
from google.protobuf.message import DecodeError
from google.protobuf.text_format import ParseError as TextParseError

from mha_onnx.errors import ModelFileError, OutputExistsError
from mha_onnx.graph.light import (
    checkable,
    data_bytes,
    external_copy,
    model_bytes,
    write_inline,
)
from mha_onnx.graph.walk import all_graphs, all_nodes

log = logging.getLogger(__name__)

# What onnxruntime 1.31 accepts (measured: IR 14 and opset 27 are refused).
MAX_IR_VERSION = 13
MAX_OPSET = 26
PROTOBUF_LIMIT = 2**31 - 1
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # leave room for the graph itself


def check_readable(path: str | os.PathLike[str], what: str = "model") -> Path:
    """The path as a Path, or ModelFileError saying why it cannot be read."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{what} not found: {path}")
    if path.is_dir():
        raise ModelFileError(f"{what} path is a folder, not a file: {path}")
    if not os.access(path, os.R_OK):
        raise ModelFileError(f"{what} is not readable: {path}", hint="check its permissions")
    if path.stat().st_size == 0:
        raise ModelFileError(f"{what} is empty: {path}")
    return path


def read_model(path: str | os.PathLike[str], *, load_external_data: bool = True) -> onnx.ModelProto:
    """Parse an ONNX file and check it is a well-formed model (onnx.checker, without shape
    inference); external data is loaded only from inside the model's folder."""
    path = check_readable(path)
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, ParseError, TextParseError, RuntimeWarning, ValueError,
            TypeError) as exc:
        raise ModelFileError(
            f"{path} is not a valid ONNX model (protobuf parse failed: {type(exc).__name__})",
            hint="the file may be truncated or not an .onnx file (onnx reads a .json or .txt "
                 "path as text)",
        ) from exc
    except OSError as exc:
        raise ModelFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelFileError(
            f"{path} holds no ONNX graph", hint="the file may be truncated or not an .onnx file"
        )
    check_versions(model, path)
    if load_external_data:
        load_external(model, path)
        check_structure(model, path)
    return model


def _check_text(message, path: str | os.PathLike[str]) -> None:
    """Every string field must be valid UTF-8 (protobuf's upb parser hands invalid ones back
    as bytes, which later crash whatever reads them)."""
    for field, value in message.ListFields():
        repeated = getattr(field, "is_repeated", None)
        if repeated is None:  # older protobuf
            repeated = field.label == field.LABEL_REPEATED
        items = value if repeated else (value,)
        if field.type == field.TYPE_MESSAGE:
            for item in items:
                _check_text(item, path)
        elif field.type == field.TYPE_STRING:
            for item in items:
                if not isinstance(item, str):
                    raise ModelFileError(
                        f"{path} is not a valid ONNX model: field {field.name!r} holds invalid "
                        f"UTF-8 text {bytes(item)[:24]!r}", hint="the file may be corrupt")


# Ops ONNX Runtime registers in the default domain that ONNX does not define (ORT GenAI's
# builder and mha-onnx's norm fusion write SimplifiedLayerNormalization there, as ORT runs it).
ORT_ONNX_DOMAIN_OPS = {"SimplifiedLayerNormalization"}


def for_checker(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for onnx.checker: ORT's own default-domain ops moved to its contrib domain
    (whose ops the checker does not judge), so that what ORT runs is not refused as corrupt.
    The model itself is not changed."""
    if not any(_ort_default_op(n) for n in all_nodes(model.graph)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in all_nodes(copy.graph):  # branches of If nodes too
        if _ort_default_op(node):
            node.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return copy


def _ort_default_op(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in ORT_ONNX_DOMAIN_OPS


def check_structure(model: onnx.ModelProto, path: str | os.PathLike[str] = "<model>") -> None:
    """onnx.checker without shape inference: catches dangling inputs, bad attributes and
    other corruption (invalid text included) before any rewrite or session sees the graph."""
    _check_text(model, path)
    try:
        if model_bytes(model) < PROTOBUF_LIMIT:
            onnx.checker.check_model(for_checker(checkable(model)))
    except (onnx.checker.ValidationError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(f"{path} is not a valid ONNX model: {first[:300]}",
                             hint="the file may be corrupt or produced by a broken exporter") from exc


def to_ir(model: onnx.ModelProto, path: str | os.PathLike[str] = "<model>"):
    """onnx_ir's view of a model; a graph it cannot represent is a ModelFileError."""
    import onnx_ir as ir

    try:
        return ir.from_proto(model)
    except Exception as exc:  # noqa: BLE001 - onnx_ir raises many types on malformed graphs
        raise ModelFileError(f"{path} cannot be read as an ONNX graph: {type(exc).__name__}: "
                             f"{str(exc)[:200]}") from exc


def external_files(model: onnx.ModelProto, path: str | os.PathLike[str]) -> list[Path]:
    """The external-data files a model refers to (checked to lie in its folder)."""
    path = Path(path)
    check_external_data(model, path.parent)
    locations = {
        entry.value
        for tensor in _external_tensors(model)
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return sorted(path.parent / loc for loc in locations)


def load_external(model: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    """Load external tensors in place, after checking every location is safe."""
    if not has_external_data(model):
        return
    check_external_data(model, Path(path).parent)
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(Path(path).parent))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot read external data of {path}: {exc}") from exc


def check_versions(model: onnx.ModelProto, path: str | os.PathLike[str] = "<model>") -> None:
    """Refuse IR versions and opsets that onnxruntime cannot load, naming the limit."""
    if model.ir_version <= 0:
        raise ModelFileError(f"{path} has no IR version; it is not a usable ONNX model")
    if model.ir_version > MAX_IR_VERSION:
        raise ModelFileError(
            f"{path} has ONNX IR version {model.ir_version}; onnxruntime reads <= {MAX_IR_VERSION}",
            hint="re-save it with a lower ir_version",
        )
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > MAX_OPSET:
            raise ModelFileError(
                f"{path} uses opset {opset.version}; onnxruntime supports <= {MAX_OPSET}"
            )
        if opset.domain in ("", "ai.onnx") and opset.version < 7:
            raise ModelFileError(f"{path} uses opset {opset.version}; mha-onnx needs >= 7")


def _external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    yield from onnx.external_data_helper._get_all_tensors(model)


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(onnx.external_data_helper.uses_external_data(t) for t in _external_tensors(model))


def check_external_data(model: onnx.ModelProto, base_dir: str | os.PathLike[str]) -> None:
    """Every external-data location must resolve inside ``base_dir``; checked before any read."""
    base = Path(base_dir).resolve()
    for tensor in _external_tensors(model):
        if not onnx.external_data_helper.uses_external_data(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise ModelFileError(f"tensor {tensor.name!r} has external data without a location")
        if os.path.isabs(location) or location.startswith(("/", "\\")):
            raise ModelFileError(
                f"refused external data of tensor {tensor.name!r}: absolute path {location!r}",
                hint="external data must lie in the model's own folder",
            )
        parts = Path(location.replace("\\", "/")).parts
        if ".." in parts:
            raise ModelFileError(
                f"refused external data of tensor {tensor.name!r}: {location!r} leaves the "
                "model's folder",
                hint="external data must lie in the model's own folder",
            )
        resolved = (base / location).resolve()
        if base != resolved and base not in resolved.parents:
            raise ModelFileError(
                f"refused external data of tensor {tensor.name!r}: {location!r} resolves to "
                f"{resolved}, outside {base} (a symlink?)",
                hint="external data must lie in the model's own folder",
            )
        if not resolved.is_file():
            raise ModelFileError(
                f"external data {location!r} of tensor {tensor.name!r} not found beside the model"
            )


def prepare_output(path: str | os.PathLike[str], *, force: bool) -> Path:
    """Check that ``path`` may be written (before any long work) and create its folder."""
    path = Path(path)
    if path.is_dir():
        raise OutputExistsError(f"output path is a folder: {path}")
    if path.exists() and not force:
        raise OutputExistsError(f"output exists: {path}", hint="pass --force to replace it")
    _make_folder(path.parent)
    return path


# the folders this process created for its outputs (the topmost of each new chain): a
# command that fails or is interrupted removes those still empty (remove_empty_outputs)
_CREATED: list[Path] = []


def _make_folder(folder: Path) -> None:
    top = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelFileError(f"cannot create folder {folder}: {exc.strerror or exc}") from exc
    if top is not None:
        _CREATED.append(top)
    _writable(folder)


def remove_empty_outputs() -> None:
    """Removes the folders this process created for outputs that hold no file (after a
    failure or an interrupt: nothing was written, and nothing is left behind)."""
    while _CREATED:
        top = _CREATED.pop()
        if not top.is_dir():
            continue
        for folder, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
            try:
                os.rmdir(folder)  # only an empty folder goes
            except OSError:
                pass


def _writable(folder: Path) -> None:
    """Refuses a folder no file can be written into (read-only, or a file system that
    takes none) now, not after the work: a probe file created and removed."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".mha_onnx_probe_"):
            pass
    except OSError as exc:
        raise ModelFileError(f"cannot write into {folder}: {exc.strerror or exc}",
                             hint="pick an output folder you can write to") from None


def prepare_folder(path: str | os.PathLike[str], *, force: bool) -> Path:
    """A folder to write into: created if missing; one that holds files is refused without
    ``force`` (its files might be replaced or mixed with new ones)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"output folder is a file: {path}")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise OutputExistsError(f"output folder is not empty: {path}",
                                hint="pass --force to write into it anyway")
    _make_folder(path)
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, force: bool) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success fsync it and rename it over ``path``.
    An exception (Ctrl-C included) removes the temp file and leaves ``path`` untouched."""
    path = prepare_output(path, force=force)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, _creation_mode())  # mkstemp makes 0600; an output is an ordinary file
    try:
        yield tmp
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        if path.exists() and not force:  # appeared while we worked
            raise OutputExistsError(f"output exists: {path}", hint="pass --force to replace it")
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _creation_mode() -> int:
    """The mode an ordinary new file gets here: 0666 less the umask (0644 under 022)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes(data: bytes, path: str | os.PathLike[str], *, force: bool) -> Path:
    with atomic_path(path, force=force) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes held by initializers and constant tensors (what decides the 2 GB limit)."""
    total = 0
    for tensor in _external_tensors(model):
        total += len(tensor.raw_data) if tensor.HasField("raw_data") else tensor.ByteSize()
    return total


def write_model(model: onnx.ModelProto, path: str | os.PathLike[str], *, force: bool,
                external: bool = False, base: Path | None = None) -> Path:
    """Save ``model`` atomically; beyond ~2 GB (or with ``external``: another file reads
    them too) the tensors of 1 KiB and more go to ``<name>.data`` beside it. ``base``: the
    folder where the external data of ``model``'s initializers lies (it is copied, tensor by
    tensor, into the file or beside it)."""
    path = Path(path)
    outside = base is not None and has_external_data(model)
    if not external and outside and data_bytes(model) < EXTERNAL_DATA_THRESHOLD:
        with atomic_path(path, force=force) as tmp, tmp.open("wb") as handle:
            write_inline(model, Path(base), handle)
        return path
    if not external and not outside and tensor_bytes(model) < EXTERNAL_DATA_THRESHOLD:
        return write_bytes(model.SerializeToString(), path, force=force)
    data_name = path.name + ".data"
    data_path = path.with_name(data_name)
    if data_path.exists() and not force:
        raise OutputExistsError(f"output exists: {data_path}", hint="pass --force to replace it")
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=prepare_output(path, force=force).parent) as tmp_dir:
        tmp_data = Path(tmp_dir) / data_name
        with tmp_data.open("wb") as handle:  # the weights streamed, not copied
            model = external_copy(model, handle, data_name, base=base if outside else None)
        onnx.external_data_helper.convert_model_to_external_data(  # (the rest: Constants,
            model, all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        onnx.external_data_helper.write_external_data_tensors(model, tmp_dir)  # branches)
        if tmp_data.stat().st_size == 0:
            tmp_data.unlink()
        if tmp_data.exists():  # (not where no tensor is 1 KiB)
            os.chmod(tmp_data, _creation_mode())
            with tmp_data.open("rb") as handle:
                os.fsync(handle.fileno())
        with atomic_path(path, force=force) as tmp_model:
            tmp_model.write_bytes(model.SerializeToString())
            if tmp_data.exists():
                os.replace(tmp_data, data_path)
    log.info("wrote %s with external data %s", path, data_path)
    return path


def all_initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Every initializer of ``graph`` and of its subgraphs (a tuned model's branches hold
    some), by name."""
    out: dict[str, onnx.TensorProto] = {}
    for sub in all_graphs(graph):
        out.update({t.name: t for t in sub.initializer if t.name not in out})
    return out
