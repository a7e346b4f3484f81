"""The suite's torch.export runs (about two thirds of its time), remembered: each function that
exports a module to an ONNX model (``mha_onnx.export.hf._torch_export``,
``mha_onnx.export.mha._torch_export``, ``tests.models.export``) is looked up by what decides
its result before it runs.

The key of an export is a SHA-256 over everything its model depends on: the versions of
torch, transformers, onnx, onnxscript and onnx-ir; the source of the code the exporting
function runs (``FILES`` and, in ``export/hf.py``, the functions that make the example
inputs and call torch.onnx.export; ``rewrite/faithful.py``, the clean-up each export runs;
``tests/models.py`` for the test library's);
for every submodule, its class and the source file of that class where it lies in this
repository, its plain attributes (a Hugging Face config through its JSON) and the forward
hooks this package puts on it (export --keep-float32's casts); every
parameter and buffer, bytes included; the example arguments, values included; and the
other arguments. A model is remembered as the function returned it (the repository's path
in its stack traces kept as a placeholder, so that another clone reads it as its own), first
in
``tests/fixtures/exports/`` (made by ``make test-exports``: the suite run once with
``MHA_ONNX_RECORD_EXPORTS`` set; those of 5 MB or less), then in the run's own folder shared
by the test workers;
anything else is exported. A change to the exporting code, a model or a version misses the
store and exports afresh: nothing stale is read. ``tests/test_export_memo.py`` checks a
remembered model against a fresh export, byte for byte.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "tests" / "fixtures" / "exports"
RECORD = "MHA_ONNX_RECORD_EXPORTS"  # set: new exports are written into COMMITTED too
COMMITTED_BYTES = 5 << 20  # larger exports are made at run time
# Property tests whose examples are exports draw the same examples every run (derandomized;
# no shrinking: each example is an export), so that their exports are in the store;
# MHA_ONNX_EXPLORE=N draws N fresh ones.
EXPLORE = int(os.environ.get("MHA_ONNX_EXPLORE", "0"))


def exporting_examples(count: int):
    """Hypothesis settings for a property test whose examples export models (above)."""
    from hypothesis import HealthCheck, Phase, settings

    return settings(max_examples=EXPLORE or count, derandomize=not EXPLORE, deadline=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=list(HealthCheck))


def _versions() -> bytes:
    import onnx
    import onnx_ir
    import onnxscript
    import torch

    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = "-"
    return f"{torch.__version__}|{tf}|{onnx.__version__}|{onnxscript.__version__}|" \
           f"{onnx_ir.__version__}".encode()


_FILES: dict[str, bytes] = {}


def _file_digest(path: str) -> bytes:
    if path not in _FILES:
        _FILES[path] = hashlib.sha256(Path(path).read_bytes()).digest()
    return _FILES[path]


# the code an export function runs besides its module's classes (whose files are hashed
# anyway): what a change to invalidates its remembered models. Whole files, and in
# export/hf.py (which also holds the export's report and checks) the functions that make the
# example inputs and call torch.onnx.export, and the dim names they give.
FILES = {
    "hf": ("mha_onnx/reference/hf.py", "mha_onnx/rewrite/faithful.py"),
    "mha": ("mha_onnx/export/mha.py", "mha_onnx/reference/mha.py", "mha_onnx/config.py",
            "mha_onnx/rewrite/faithful.py"),
    "zoo": ("tests/models.py",),
}
HF_FUNCTIONS = ("_torch_export", "_examples", "_seq2seq_examples", "_random")
_CODES: dict[str, bytes] = {}


def _code(kind: str = "hf") -> bytes:
    if kind not in _CODES:
        digest = b"".join(_file_digest(str(ROOT / path)) for path in FILES[kind])
        if kind == "hf":
            import inspect

            import mha_onnx.export.hf as hf

            text = [inspect.getsource(getattr(getattr(hf, name), "original",
                                              getattr(hf, name))) for name in HF_FUNCTIONS]
            text.append(repr((hf.NEW, hf.PAST, hf.TOTAL)))
            digest += hashlib.sha256("\n".join(text).encode()).digest()
        _CODES[kind] = digest
    return _CODES[kind]


def _plain(value: Any, depth: int = 0) -> str:
    """A value as text that is the same in every process (no addresses)."""
    if depth > 4:
        return type(value).__name__
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_plain(v, depth + 1) for v in value) + "]"
    if isinstance(value, set | frozenset):
        return "{" + ",".join(sorted(_plain(v, depth + 1) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_plain(k, depth + 1)}:{_plain(v, depth + 1)}"
                              for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if hasattr(value, "to_json_string"):  # a transformers config
        return value.to_json_string()
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    kind = type(value)
    if kind.__module__ == "torch" or kind.__name__ in ("dtype", "device"):
        return str(value)
    return f"<{kind.__module__}.{kind.__qualname__}>"


def _tensor(h, tensor) -> None:
    h.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
    data = tensor.detach().cpu().contiguous()
    h.update(data.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
             if data.numel() else b"")


def _args(h, value: Any) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        _tensor(h, value)
    elif isinstance(value, list | tuple):
        h.update(b"[")
        for v in value:
            _args(h, v)
        h.update(b"]")
    elif isinstance(value, dict):
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _args(h, value[k])
    else:
        h.update(_plain(value).encode())


def key(module, args: tuple, options: Any, code: bytes = b"") -> str | None:
    """The export's key (module doc; ``code``: the digests of the exporting code), or None
    where it cannot be made sure of (a module whose class is defined outside a file)."""
    import inspect

    h = hashlib.sha256(_versions() + code)
    for name, sub in module.named_modules():
        kind = type(sub)
        h.update(f"{name}:{kind.__module__}.{kind.__qualname__}".encode())
        try:
            source = inspect.getsourcefile(kind)
        except TypeError:
            return None
        if source and str(ROOT) in str(Path(source).resolve()):
            h.update(_file_digest(source))
        attributes = {k: v for k, v in vars(sub).items() if not k.startswith("_")
                      and k not in ("training", "name_or_path")}  # (not the folder it came from)
        h.update(_plain(attributes).encode())
        ours = [_plain(f) for hooks in (sub._forward_pre_hooks, sub._forward_hooks)
                for f in hooks.values() if getattr(f, "__module__", "").startswith("mha_onnx")]
        if ours:  # (export --keep-float32's casts: a module without weights has no other sign)
            h.update(f"hooks:{ours}".encode())
    for name, tensor in module.state_dict(keep_vars=True).items():
        h.update(name.encode())
        _tensor(h, tensor)
    _args(h, args)
    h.update(_plain(_dims(options)).encode())
    return h.hexdigest()[:32]


def _dims(value: Any) -> Any:
    """Dynamic shapes as plain data (a torch.export Dim by its name and bounds)."""
    if isinstance(value, dict):
        return {k: _dims(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_dims(v) for v in value]
    if hasattr(value, "__name__") and hasattr(value, "min"):
        return f"Dim({value.__name__},{getattr(value, 'min', None)},{getattr(value, 'max', None)})"
    return value


HERE = "{MHA_ONNX_ROOT}"  # the repository's path in a remembered model's stack traces


def _relocated(proto, old: str, new: str):
    """``proto`` with ``old`` replaced by ``new`` in its nodes' metadata (torch.onnx records
    each node's stack trace, with the repository's absolute path in it), in place."""
    from mha_onnx.graph.walk import all_nodes

    for node in all_nodes(proto.graph):
        for prop in node.metadata_props:
            if old in prop.value:
                prop.value = prop.value.replace(old, new)
    return proto


def remembered(export, keyed, run_folder: Path, kind: str = "hf"):
    """``export`` (a function returning an ONNX ModelProto) with its models remembered;
    ``keyed(*args, **kwargs)`` -> (module, example arguments, other options) of a call;
    ``kind``: which of FILES it runs."""
    import onnx

    def memo(*args, **kwargs):
        module, examples, options = keyed(*args, **kwargs)
        name = key(module, examples, options, _code(kind))
        if name is None:
            return export(*args, **kwargs)
        for folder in (COMMITTED, run_folder):
            path = folder / f"{name}.onnx"
            if path.is_file():  # (stack traces in this clone, as a fresh export writes them)
                return _relocated(onnx.load(path), HERE, str(ROOT))
        proto = export(*args, **kwargs)
        stored = onnx.ModelProto()
        stored.CopyFrom(proto)
        data = _relocated(stored, str(ROOT), HERE).SerializeToString()
        record = os.environ.get(RECORD) and len(data) <= COMMITTED_BYTES
        targets = [run_folder] + ([COMMITTED] if record else [])
        for folder in targets:
            folder.mkdir(parents=True, exist_ok=True)
            temporary = folder / f".{name}.{os.getpid()}.tmp"
            temporary.write_bytes(data)
            temporary.replace(folder / f"{name}.onnx")  # (atomic: the other worker reads it)
        return proto

    memo.original = export
    return memo


def install(patch, run_folder: Path) -> None:
    """The three export functions remembered for the session (``patch``: a MonkeyPatch)."""
    import mha_onnx.export.hf as hf
    import mha_onnx.export.mha as mha
    import tests.models as models

    def hf_keys(task, config, model, dtype, opset, part=None):
        return model, (), {"task": task, "dtype": dtype, "opset": opset, "part": part,
                           "config": config}

    def mha_keys(module, config, opset):
        return module, (), {"config": repr(config), "opset": opset}

    def zoo_keys(module, args, dynamic, *, opset=18, names=None):
        return module, args, {"dynamic": dynamic, "opset": opset, "names": names}

    for owner, name, keyed, kind in ((hf, "_torch_export", hf_keys, "hf"),
                                     (mha, "_torch_export", mha_keys, "mha"),
                                     (models, "export", zoo_keys, "zoo")):
        patch.setattr(owner, name, remembered(getattr(owner, name), keyed, run_folder, kind))
