"""Golden outputs: the inputs a ``validate`` run fed, the outputs it got and where they came
from (model sha256, provider, machine), saved to one ``.npz`` so that another machine can run
the same inputs and compare (Polygraphy's --save-outputs / --load-outputs habit: check on a
laptop, check again on the production GPU)."""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx import __version__
from mha_onnx.errors import InputSpecError
from mha_onnx.graph.files import atomic_path
from mha_onnx.graph.metadata import CheckResult

FORMAT = "mha-onnx golden outputs 1"


@dataclass(frozen=True)
class GoldenRun:
    case: str
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_golden(path: str | Path, runs: list[GoldenRun], provenance: dict[str, Any], *,
                force: bool = False) -> None:
    """Write ``runs`` and their provenance (atomically; no silent replacement)."""
    arrays: dict[str, np.ndarray] = {}
    for n, run in enumerate(runs):
        for kind, values in (("input", run.inputs), ("output", run.outputs)):
            for name, array in values.items():
                arrays[f"{n}/{kind}/{name}"] = np.asarray(array)
    meta = {"format": FORMAT, "cases": [r.case for r in runs], "mha_onnx": __version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **provenance}
    arrays["provenance"] = np.array(json.dumps(meta, sort_keys=True))
    with atomic_path(path, force=force) as tmp, tmp.open("wb") as handle:
        np.savez_compressed(handle, **arrays)


def load_golden(path: str | Path) -> tuple[list[GoldenRun], dict[str, Any]]:
    """The runs of a golden file and its provenance; a file that is not one is refused."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["provenance"]))
            if meta.get("format") != FORMAT:
                raise KeyError("format")
            runs = []
            for n, case in enumerate(meta["cases"]):
                values: dict[str, dict[str, np.ndarray]] = {"input": {}, "output": {}}
                for key in data.files:
                    index, _, rest = key.partition("/")
                    kind, _, name = rest.partition("/")
                    if index == str(n) and kind in values:
                        values[kind][name] = data[key]
                runs.append(GoldenRun(case, values["input"], values["output"]))
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise InputSpecError(f"{path} is not a golden-outputs file written by "
                             f"'mha-onnx validate --save-outputs' ({type(exc).__name__})") from exc
    return runs, meta


class GoldenReference:
    """Stored outputs as a reference: the outputs of the stored run whose inputs these are."""

    def __init__(self, runs: list[GoldenRun], meta: dict[str, Any], path: str) -> None:
        self.runs = runs
        self.meta = meta
        self.label = (f"golden = {path} (saved {meta.get('created', '?')} on "
                      f"{meta.get('machine', {}).get('processor', '?')}, provider "
                      f"{meta.get('provider', '?')}, model sha256 "
                      f"{str(meta.get('model_sha256', '?'))[:12]})")

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for run in self.runs:
            if run.inputs.keys() == feeds.keys() and all(
                    np.array_equal(run.inputs[k], feeds[k]) for k in feeds):
                return run.outputs
        raise InputSpecError("these inputs are not in the golden file")


def golden_provenance(golden: GoldenReference, path: str | Path, strict: bool) -> list:
    """Was the golden file saved from this very model? A different sha256 is said (a fused
    model checked against its original's golden outputs is legitimate); --strict fails it."""
    saved = golden.meta.get("model_sha256")
    here = file_sha256(path)
    if saved == here:
        return [CheckResult("golden model", True, "saved from this model (same sha256)")]
    detail = (f"saved from another model (sha256 {str(saved)[:12]}, this one {here[:12]}, "
              f"{golden.meta.get('model', '?')})")
    return [CheckResult("golden model", not strict, detail + ("" if strict else "; compared "
                                                             "anyway (--strict fails this)"))]


def golden_coverage(golden: GoldenReference, model, comparisons: Sequence[Any]) -> CheckResult:
    """Every output of the model is compared with the golden file, else the check fails."""
    outputs = [o.name for o in model.graph.output]
    stored = sorted({name for run in golden.runs for name in run.outputs})
    compared = {c.output for c in comparisons if c.against == "golden"}
    missing = [o for o in outputs if o not in compared]
    if not compared or missing:
        return CheckResult("golden outputs", False,
                           f"{len(compared)} of {len(outputs)} outputs compared: the golden file "
                           f"holds {stored[:6]}, the model has {outputs[:6]}")
    return CheckResult("golden outputs", True,
                       f"{len(outputs)} output(s) compared over {len(golden.runs)} stored run(s)")
