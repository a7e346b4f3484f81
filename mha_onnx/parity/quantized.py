"""``validate`` of a quantized model: not float tolerances (a 4-bit model differs from its
float original by design) but the accuracy report against that original (``--reference``,
else the file ``quantize`` recorded, when it is still there and unchanged), and the same
model on every other requested runtime against ONNX Runtime's CPU at float tolerances (a
runtime that cannot run MatMulNBits, OpenVINO among them: exit 3 with its reason)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mha_onnx.errors import EXIT_MISMATCH, EXIT_OK, EXIT_PROVIDER, ConfigError
from mha_onnx.graph import metadata
from mha_onnx.quantize import accuracy


@dataclass(frozen=True)
class RuntimeParity:
    provider: str
    ran: bool
    reason: str = ""
    max_abs: float | None = None
    passed: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "ran": self.ran, "reason": self.reason,
                "max_abs": self.max_abs, "passed": self.passed}


@dataclass(frozen=True)
class QuantizedValidation:
    model: str
    reference: str
    accuracy: accuracy.AccuracyReport
    runtimes: tuple[RuntimeParity, ...]
    allow_missing: bool
    seconds: float
    notes: tuple[str, ...] = field(default=())

    @property
    def exit_code(self) -> int:
        if not self.accuracy or not all(r.passed for r in self.runtimes if r.ran):
            return EXIT_MISMATCH
        if not self.allow_missing and not all(r.ran for r in self.runtimes):
            return EXIT_PROVIDER
        return EXIT_OK

    def __bool__(self) -> bool:
        return self.exit_code == EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "passed": bool(self), "exit_code": self.exit_code,
                "quantized": True, "reference": self.reference,
                "accuracy": self.accuracy.to_dict(),
                "runtimes": [r.to_dict() for r in self.runtimes],
                "seconds": round(self.seconds, 3), "notes": list(self.notes)}

    def render(self, detail: bool = False) -> str:
        del detail  # (one summary: the figures are few)
        lines = [f"validate {self.model} (quantized)",
                 f"  accuracy against the float model {self.reference}:",
                 *self.accuracy.render("    ")]
        for r in self.runtimes:
            state = (f"max abs {r.max_abs:.3g} vs ORT CPU, {'pass' if r.passed else 'FAIL'}"
                     if r.ran else f"COULD NOT RUN: {r.reason}")
            lines.append(f"  provider {r.provider}: {state}")
        lines += [f"  note: {n}" for n in self.notes]
        verdict = {EXIT_OK: "PASSED", EXIT_MISMATCH: "FAILED: past the accuracy thresholds "
                   "or runtimes differ", EXIT_PROVIDER: "FAILED: a requested provider could "
                   "not run"}[self.exit_code]
        lines.append(f"  result: {verdict} ({self.seconds:.1f} s)")
        return "\n".join(lines)


def is_quantized(model: onnx.ModelProto) -> bool:
    return "quantization" in metadata.read(model)


def float_original(model: onnx.ModelProto, reference: str | None) -> str:
    """The float model to measure against: ``reference``, else the source quantize recorded
    (refused where it is gone or changed)."""
    if reference:
        return reference
    record = metadata.loaded(model, "quantization") or {}
    source = record.get("source")
    if not source or not Path(source).is_file():
        raise ConfigError("the float model this one was quantized from is not at "
                          f"{source or 'a recorded path'}",
                          hint="pass --reference FLOAT.onnx")
    if record.get("source_sha256") != hashlib.sha256(Path(source).read_bytes()).hexdigest():
        raise ConfigError(f"{source} changed since this model was quantized from it",
                          hint="pass --reference FLOAT.onnx")
    return source


def thresholds_for(model: onnx.ModelProto, given) -> accuracy.Thresholds:
    """The thresholds ``model`` was quantized with (its record; a file quantized with
    ``--min-top1 0`` is judged by that, not by the defaults), with those ``given`` (a dict
    of Thresholds' fields) over them."""
    record = metadata.loaded(model, "quantization") or {}
    recorded = record.get("accuracy", {}).get("thresholds", {})
    known = {k: v for k, v in recorded.items() if k in accuracy.Thresholds.__dataclass_fields__}
    return accuracy.Thresholds(**{**known, **(given or {})})


def validate_quantized(path: str | Path, config) -> QuantizedValidation:
    """``config``: validate's (providers, reference, allow_missing, the accuracy
    thresholds)."""
    from mha_onnx.graph.files import read_model
    from mha_onnx.quantize.run import measure

    started = time.perf_counter()
    model = read_model(path)
    thresholds = thresholds_for(model, config.accuracy)
    try:
        reference = float_original(model, config.reference)
    except ConfigError:
        if "hf_model" not in metadata.read(model):
            raise
        reference, report = _against_torch(model, str(path), thresholds)
    else:  # (on the prompts quantize measured it on, where it was given some)
        prompts = (metadata.loaded(model, "quantization") or {}).get("eval_prompts")
        report = measure(read_model(reference), reference, model, thresholds, prompts=prompts)
    runtimes = tuple(_parity(str(path), model, p) for p in config.providers if p != "cpu")
    return QuantizedValidation(str(path), reference, report, runtimes, config.allow_missing,
                               time.perf_counter() - started)


def _against_torch(model: onnx.ModelProto, path: str, thresholds: accuracy.Thresholds):
    """A quantized `export --model` whose float export is gone: its logits against the
    folder's PyTorch model's (float32), on the accuracy run's prompts (no greedy run)."""
    from mha_onnx.quantize.feeds import decoder_feeds, session_outputs
    from mha_onnx.reference.hf import HfReference
    from mha_onnx.rewrite.last_logits import at_last

    record = metadata.loaded(model, "hf_model") or {}
    torch = HfReference(record, "PyTorch")
    feeds, _ = decoder_feeds(model, path, accuracy.PROMPTS, accuracy.PROMPT_LENGTH, seed=0)
    got = session_outputs(model, feeds)
    plain = {k: v for k, v in feeds.items() if k != "past_sequence_length"}
    for name, value in plain.items():  # PyTorch takes the appended interface: empty pasts
        if name.startswith("past_key_values."):  # (an int8 cache's: PyTorch's are float)
            plain[name] = value[:, :, :0].astype(np.float32 if value.dtype == np.int8
                                                  else value.dtype)
    want = torch.infer(plain)
    logits = at_last(want["logits"], feeds) if got["logits"].shape[1] == 1 else want["logits"]
    errors, figures = accuracy.compare({"logits": logits}, {"logits": got["logits"]})
    report = accuracy.AccuracyReport(tuple(errors), figures["positions"], figures["kl_mean"],
                                     figures["kl_max"], figures["top1"], thresholds=thresholds,
                                     notes=("the float export this model was quantized from "
                                            "is gone: measured against the folder's PyTorch "
                                            "model (logits only, no greedy run)",))
    return f"PyTorch model of {record.get('folder')}", report


def _parity(path: str, model: onnx.ModelProto, provider: str) -> RuntimeParity:
    """The quantized model on ``provider`` against ORT CPU, on the accuracy run's inputs."""
    from mha_onnx.errors import ProviderError
    from mha_onnx.quantize.feeds import decoder_feeds, generic_feeds, is_decoder
    from mha_onnx.runtime import make_runner
    from mha_onnx.runtime.ort import OrtRunner

    feeds = decoder_feeds(model, path, 2, 16, seed=1)[0] if is_decoder(model, path) \
        else generic_feeds(model, seed=1)
    try:
        with make_runner(path, provider) as runner:
            got = runner.infer(feeds)
    except ProviderError as exc:
        reason = str(exc)
        if provider.startswith("openvino"):
            reason = f"not supported by openvino: {reason}"
        return RuntimeParity(provider, False, reason)
    with OrtRunner(path) as runner:
        want = runner.infer(feeds)
    worst = max(float(np.abs(want[k].astype(np.float64) - got[k]).max()) for k in want)
    scale = max(float(np.abs(want[k]).max()) for k in want)
    return RuntimeParity(provider, True, max_abs=worst,
                         passed=worst <= _relative_tolerance(model) * max(1.0, scale))


def _relative_tolerance(model: onnx.ModelProto) -> float:
    """1e-3 of the outputs' scale; 1e-2 where ORT's MatMulNBits runs at accuracy level 4,
    which quantizes the activations to int8 per block on ORT's side while the other runtime
    multiplies them in float (OpenVINO beside ORT on the Llama fixture's int4 export: max abs
    0.0052 on an AMD EPYC, past 1e-3 of the scale; within it on the Intel Xeon of earlier
    sessions)."""
    from mha_onnx.graph.walk import all_nodes, attr

    nodes = list(all_nodes(model.graph))
    levels = {attr(n, "accuracy_level", 0) for n in nodes if n.op_type == "MatMulNBits"}
    rows = any(n.op_type == "MatMulIntegerToFloat" for n in nodes)  # (w8a8: int8 rows too)
    return 1e-2 if 4 in levels or rows else 1e-3
