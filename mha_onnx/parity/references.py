"""What a model is compared against: the PyTorch reference rebuilt from an mha-onnx
export's metadata and weights, and another ONNX model (``--reference``) on ORT CPU."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mha_onnx.errors import InputSpecError, MhaOnnxError, RuntimeCrash
from mha_onnx.graph import metadata
from mha_onnx.graph.cache import SharedCache, is_shared, row_layout, shared_view
from mha_onnx.graph.files import (
    all_initializers,
    check_structure,
    has_external_data,
    load_external,
    read_model,
)
from mha_onnx.graph.inputs import input_specs
from mha_onnx.graph.metadata import CheckResult, session_options
from mha_onnx.graph.preflight import preflight
from mha_onnx.parity.config import ValidateConfig
from mha_onnx.parity.golden import golden_provenance
from mha_onnx.parity.held import router_indices
from mha_onnx.runtime.ort import OrtRunner


def _weight(arrays: dict, packed: dict, name: str) -> np.ndarray | None:
    """An initializer as float32, or its columns (a bias: its values) of the one fuse packed
    it into."""
    from onnx import numpy_helper

    if name in arrays:
        return numpy_helper.to_array(arrays[name]).astype(np.float32)
    try:
        joined, start, end = packed[name]
        whole = arrays.get(joined)
        return None if whole is None else \
            numpy_helper.to_array(whole).astype(np.float32)[..., int(start):int(end)]
    except (KeyError, TypeError, ValueError) as exc:
        if name not in packed:
            return None
        raise metadata.damaged("packed", f"entry {name!r}: {exc!r}") from exc


class TorchReference:
    """The PyTorch reference rebuilt from an export's metadata and initializers (float32)."""

    def __init__(self, source: onnx.ModelProto, label: str) -> None:
        import torch

        from mha_onnx.reference.mha import build_reference
        from mha_onnx.reference.weights import checksum

        meta = metadata.read(source)
        config = metadata.config_of(source)
        assert config is not None
        self.config = config
        params = metadata.loaded(source, "params") or {}
        arrays = all_initializers(source.graph)  # (a tuned model's may lie in its branches)
        packed = metadata.loaded(source, "packed") or {}
        state = {}
        for name, where in params.items():
            try:
                initializer, transposed = where["initializer"], bool(where["transposed"])
            except (KeyError, TypeError) as exc:
                raise metadata.damaged("params", f"entry {name!r}: {exc!r}") from exc
            array = _weight(arrays, packed, initializer)
            if array is None:
                raise MhaOnnxError(f"{label}: initializer {initializer!r} of {name} is missing",
                                   hint="the file was rewritten in a way mha-onnx cannot follow")
            state[name] = torch.from_numpy(np.ascontiguousarray(array.T if transposed else array))
        try:
            self.module = build_reference(self.config.replace(dtype="float32"), state)
        except (KeyError, RuntimeError) as exc:  # parameters missing or of the wrong shape
            raise metadata.damaged("params", exc) from exc
        self.digest_ok = checksum(state) == meta.get("weights_sha256")
        self.label = label

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from mha_onnx.reference.mha import run_reference

        return run_reference(self.module, dict(feeds))


def references_for(model: onnx.ModelProto, path: str, config: ValidateConfig, *,
                   needed: bool = True):
    """{"pytorch": TorchReference, "reference": OrtRunner}, their labels, integrity checks and
    the reference model's input specs. The PyTorch reference comes from ``--reference``'s
    metadata when it has some, so a modified file cannot vouch for itself."""
    references: dict[str, Any] = {}
    labels: list[str] = []
    checks: list[CheckResult] = []
    ref_model = read_model(config.reference) if config.reference else None
    ref_specs = input_specs(ref_model) if ref_model is not None else None
    specs = shared_view(model)[0]  # a shared cache: compared through the appended interface
    if ref_specs is not None and [s.name for s in ref_specs] != [s.name for s in specs]:
        raise InputSpecError(
            f"--reference {config.reference} has inputs {[s.name for s in ref_specs]}, the model "
            f"has {[s.name for s in specs]}")
    source = None
    if ref_model is not None and "config" in metadata.read(ref_model):
        source = (ref_model, f"PyTorch reference rebuilt from {config.reference}")
    elif "config" in metadata.read(model):
        source = (model, f"PyTorch reference rebuilt from {path}")
    hf = metadata.loaded(model, "hf_model") if "hf_model" in metadata.read(model) else None
    if hf and source is None:  # exported by `export --model`: the folder's PyTorch model
        from mha_onnx.reference.hf import HfReference

        torch_ref = HfReference(hf, f"PyTorch {hf.get('task')} model of {hf.get('folder')}")
        references["pytorch"] = torch_ref
        labels.append(f"pytorch = {torch_ref.label}")
        checks.append(CheckResult("weights", torch_ref.digest_ok,
                                  "the folder's config and weights match the sha256 recorded at "
                                  "export" if torch_ref.digest_ok else "the folder's config or "
                                  "weights changed since the export"))
    if source is not None:
        torch_ref = TorchReference(*source)
        references["pytorch"] = torch_ref
        labels.append(f"pytorch = {torch_ref.label}")
        detail = ("weights match the checksum recorded at export" if torch_ref.digest_ok else
                  "weights differ from the checksum recorded at export (the file was modified "
                  "after export)")
        checks.append(CheckResult("weights", torch_ref.digest_ok, detail))
        own = metadata.read(model).get("weights_sha256")
        if source[0] is not model and own and own != metadata.read(ref_model).get("weights_sha256"):
            checks.append(CheckResult("same export", False,
                                      "model and --reference record different weights"))
    if ref_model is not None:
        references["reference"], label = _reference_runner(ref_model, config)
        labels.append(label)
    if metadata.loaded(model, "logits"):  # --logits last: theirs at each row's position
        from mha_onnx.rewrite.last_logits import LastPosition

        references = {k: LastPosition(v) for k, v in references.items()}
    if not references and needed:
        raise MhaOnnxError(
            f"{path} has no mha-onnx metadata to rebuild the PyTorch reference from",
            hint="pass --reference ORIGINAL.onnx (e.g. the unfused model)")
    return references, labels, checks, ref_specs


def _reference_runner(ref_model: onnx.ModelProto, config: ValidateConfig):
    """``--reference`` on ORT CPU, at an optimisation level ORT does not crash at; its label."""
    checked = preflight(str(config.reference), "cpu",
                        session_options(ref_model).get("optimization", "all"))
    if checked.level is None and checked.crashed:
        raise RuntimeCrash(f"--reference {config.reference}: {checked.message()}")
    level = checked.level or "all"  # the reference only has to compute right answers
    runner: Any = OrtRunner(ref_model.SerializeToString(), "cpu", threads=config.threads,
                            optimization=level)
    if is_shared(ref_model):  # behind the appended interface, as the model is (run.py)
        specs, pairs = shared_view(ref_model)
        runner = SharedCache(runner, specs, pairs, rows=row_layout(ref_model))
    return runner, (f"reference = {config.reference} on ORT CPU"
                    + (f" ({checked.message()})" if checked.crashed else ""))


def with_golden(model, path, config: ValidateConfig, golden):
    """references_for's, with a golden file's outputs as one more reference."""
    references, labels, checks, ref_specs = references_for(  # (--ranges needs none)
        model, str(path), config, needed=golden is None and not config.ranges)
    if golden is not None:
        references["golden"] = golden
        labels.append(golden.label)
        checks += golden_provenance(golden, path, config.strict)
    return references, labels, checks, ref_specs


def model_to_validate(path: str | Path, config: ValidateConfig) -> onnx.ModelProto:
    """The model, its weights read in only where something here reads them (a reference
    rebuilt from them, routers held, --ranges, the memory check): an exported file's
    PyTorch reference loads its own weights, and ORT maps the file's in place (the trial
    runs that read its dims too: validate runs under graph.trials.weights_at)."""
    model = read_model(path, load_external_data=False)  # (read_model's load and check:)
    if not has_external_data(model) or "config" in metadata.read(model) \
            or config.memory_check or config.ranges or router_indices(model):
        load_external(model, path)  # (nothing to load where the weights are inside)
    check_structure(model, path)
    return model
