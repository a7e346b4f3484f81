"""Export of the reference to ONNX with truly dynamic batch and sequence axes, checked.

The exported graph follows the contract of :func:`mha_onnx.config.graph_inputs`; its
metadata_props carry the config, the package version, the weights' checksum and where each
parameter lives, so later stages can rebuild the PyTorch reference from the file alone.
Nothing is written unless every post-export check passed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mha_onnx import __version__
from mha_onnx.config import TOTAL_SEQ, MhaConfig, TensorSpec, graph_inputs, graph_outputs
from mha_onnx.errors import ExportError
from mha_onnx.graph import metadata
from mha_onnx.graph.files import MAX_IR_VERSION, MAX_OPSET, prepare_output, write_model
from mha_onnx.graph.inputs import ShapeCase, contract_specs, make_inputs
from mha_onnx.graph.metadata import CheckResult
from mha_onnx.rewrite.faithful import optimize_faithfully
from mha_onnx.stats import compare
from mha_onnx.table import human_bytes, table

log = logging.getLogger(__name__)

DEFAULT_OPSET = 20
MIN_OPSET = 18
# Example sizes for tracing: >= 2 and pairwise distinct so torch.export keeps them symbolic.
EXAMPLE_BATCH, EXAMPLE_SEQ_Q, EXAMPLE_SEQ_KV = 2, 5, 7
# (batch, seq_q, seq_kv) checked after export; none equals the example.
CHECK_SHAPES = ((1, 1, 1), (1, 13, 6), (3, 37, 41), (2, 64, 3))
# KV-cache models: (batch, seq_q, past_seq): a prompt (no past), single steps, a chunk.
CACHE_CHECK_SHAPES = ((1, 6, 0), (2, 1, 9), (3, 5, 7), (1, 1, 33))


@dataclass(frozen=True)
class ExportReport:
    path: str
    config: MhaConfig
    opset: int
    ir_version: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weights_sha256: str
    weights_source: str
    file_bytes: int
    seconds: float
    checks: tuple[CheckResult, ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "passed": bool(self),
            "config": self.config.to_dict(),
            "opset": self.opset,
            "ir_version": self.ir_version,
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
            "weights_sha256": self.weights_sha256,
            "weights_source": self.weights_source,
            "file_bytes": self.file_bytes,
            "seconds": round(self.seconds, 3),
            "checks": [c.to_dict() for c in self.checks],
        }

    def render(self) -> str:
        cfg = self.config
        lines = [
            f"exported {self.path} ({human_bytes(self.file_bytes)}, opset {self.opset}, "
            f"IR {self.ir_version}) in {self.seconds:.1f} s",
            f"  config: {cfg.name}: d_model {cfg.d_model}, heads {cfg.num_heads}, d_k {cfg.d_k}, "
            f"d_v {cfg.d_v}, bias {str(cfg.bias).lower()}, {cfg.attention}-attention, "
            f"mask {cfg.mask}, {cfg.dtype}",
            f"  weights: {self.weights_source}, sha256 {self.weights_sha256[:16]}...",
            "  inputs:  " + "; ".join(_spec(s) for s in self.inputs),
            "  outputs: " + "; ".join(_spec(s) for s in self.outputs),
            "  checks:",
            table(["check", "result", "detail"],
                  [(c.name, "pass" if c.passed else "FAIL", c.detail) for c in self.checks],
                  indent="    "),
        ]
        return "\n".join(lines)


def _spec(spec: TensorSpec) -> str:
    return f"{spec.name} {spec.dtype}[{', '.join(str(d) for d in spec.dims)}]"


def _exportable(config: MhaConfig) -> type:
    """A subclass of the reference whose forward takes exactly the contract's inputs."""
    from mha_onnx.reference.mha import MultiHeadAttention

    cross, padded = config.attention == "cross", config.mask == "key-padding"

    class Exportable(MultiHeadAttention):
        if config.kv_cache and config.cache_padding:

            def forward(self, query, past_key, past_value, key_padding_mask):  # type: ignore[override]
                return self.step(query, past_key, past_value, key_padding_mask)

        elif config.kv_cache:

            def forward(self, query, past_key, past_value):  # type: ignore[override]
                return self.step(query, past_key, past_value)

        elif cross and padded:

            def forward(self, query, key, value, key_padding_mask):  # type: ignore[override]
                return super().forward(query, key, value, key_padding_mask)

        elif cross:

            def forward(self, query, key, value):  # type: ignore[override]
                return super().forward(query, key, value)

        elif padded:

            def forward(self, query, key_padding_mask):  # type: ignore[override]
                return super().forward(query, key_padding_mask=key_padding_mask)

        else:

            def forward(self, query):  # type: ignore[override]
                return super().forward(query)

    return Exportable


def export_model(
    config: MhaConfig,
    output: str | Path,
    *,
    weights: str | Path | None = None,
    opset: int | None = None,
    force: bool = False,
    seed: int = 0,
) -> ExportReport:
    """Export ``config`` (random weights from ``seed`` unless ``weights``) to ``output``."""
    from mha_onnx.reference.weights import checksum

    started = time.perf_counter()
    opset = DEFAULT_OPSET if opset is None else opset
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"opset {opset} is not supported", hint=f"use {MIN_OPSET}..{MAX_OPSET}")
    output = prepare_output(output, force=force)
    module32, state32 = _reference_and_weights(config, weights, seed)
    source = f"file:{Path(weights).name}" if weights is not None else f"random(seed={seed})"
    digest = checksum(state32)
    model = _export_with_weights(config, state32, opset)
    metadata.write(model, {"version": __version__, "config": config.to_json(),
                           "weights_sha256": digest, "weights_source": source,
                           "params": _locate_params(model, state32)}, keep_others=False)
    model.producer_name, model.producer_version = "mha-onnx", __version__
    checks = _post_export_checks(model, config, module32)
    failed = [c for c in checks if not c.passed]
    if failed:
        raise ExportError(f"post-export check {failed[0].name!r} failed: {failed[0].detail}",
                          hint="nothing was written; run with -v for details")
    write_model(model, output, force=force)
    return ExportReport(
        path=str(output), config=config, opset=opset, ir_version=model.ir_version,
        inputs=graph_inputs(config), outputs=graph_outputs(config), weights_sha256=digest,
        weights_source=source, file_bytes=output.stat().st_size,
        seconds=time.perf_counter() - started, checks=tuple(checks),
    )


def _reference_and_weights(config: MhaConfig, weights: str | Path | None, seed: int):
    """The float32 PyTorch reference and its state; for float16 both hold exactly the
    weights the export will hold (rounded to float16)."""
    from mha_onnx.reference.mha import TORCH_DTYPES, build_reference
    from mha_onnx.reference.weights import load_weights

    state = load_weights(weights, config) if weights is not None else None
    module32 = build_reference(config.replace(dtype="float32"), state, seed=seed)
    state32 = {k: v.detach().clone() for k, v in module32.state_dict().items()}
    if config.dtype != "float32":
        state32 = {k: v.to(TORCH_DTYPES[config.dtype]).float() for k, v in state32.items()}
        module32.load_state_dict(state32)
    return module32, state32


def _export_with_weights(config: MhaConfig, state32: dict, opset: int) -> onnx.ModelProto:
    from mha_onnx.reference.mha import TORCH_DTYPES

    exportable = _exportable(config)(config)
    exportable.load_state_dict(state32)
    model = _torch_export(exportable.to(TORCH_DTYPES[config.dtype]).eval(), config, opset)
    _name_dims(model, config)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    return model


def _torch_export(module: Any, config: MhaConfig, opset: int) -> onnx.ModelProto:
    import torch

    dtype = module.w_q.weight.dtype
    batch = torch.export.Dim("batch", min=1)
    seq_q = torch.export.Dim("seq_q", min=1)
    seq_kv = torch.export.Dim("seq_kv", min=1) if config.attention == "cross" else seq_q
    dim_of = {"batch": batch, "seq_q": seq_q, "seq_kv": seq_kv,
              "past_seq": torch.export.Dim("past_seq", min=0),
              TOTAL_SEQ: torch.export.Dim.AUTO}  # torch finds past_seq + seq_q itself
    sizes = {"batch": EXAMPLE_BATCH, "seq_q": EXAMPLE_SEQ_Q, "seq_kv": EXAMPLE_SEQ_KV,
             "past_seq": EXAMPLE_SEQ_KV, TOTAL_SEQ: EXAMPLE_SEQ_Q + EXAMPLE_SEQ_KV}
    generator = torch.Generator().manual_seed(1234)
    args, dynamic = [], {}
    for spec in graph_inputs(config):
        named = [d for d in spec.dims if isinstance(d, str)]
        shape = [sizes[d] if isinstance(d, str) else d for d in spec.dims]
        if spec.dtype == "bool":
            args.append(torch.zeros(shape, dtype=torch.bool))
        else:  # distinct tensors: one object for q/k/v would collapse the graph inputs
            args.append(torch.randn(shape, generator=generator).to(dtype))
        dynamic[spec.name] = {i: dim_of[d] for i, d in enumerate(spec.dims) if d in named}
    names = [s.name for s in graph_inputs(config)]
    # torch.onnx warns about every absent torchvision op; nothing here uses them
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                tuple(args),
                dynamo=True,
                dynamic_shapes=dynamic,
                input_names=names,
                output_names=[o.name for o in graph_outputs(config)],
                opset_version=opset,
                optimize=False,  # its optimizer drops an epsilon <= 1e-8: ours keeps it
                verbose=False,
                report=False,
            )
    except Exception as exc:  # torch raises many types here; all mean the export failed
        log.debug("torch.onnx output:\n%s", sink.getvalue())
        raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}") from exc
    optimize_faithfully(program.model)  # a failure here is ours, not the exporter's
    return program.model_proto


def _name_dims(model: onnx.ModelProto, config: MhaConfig) -> None:
    """Give the contract's dim names to the graph's inputs and outputs, and to the same
    symbols inside the graph (so shapes stay comparable); a dynamic axis that torch
    specialised to a number is an error naming the axis."""
    specs = {s.name: s for s in graph_inputs(config) + graph_outputs(config)}
    renamed: dict[str, str] = {}
    for value in list(model.graph.input) + list(model.graph.output):
        spec = specs.get(value.name)
        if spec is None:
            raise ExportError(f"exported graph has an unexpected input/output {value.name!r}")
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(spec.dims):
            raise ExportError(f"{value.name} has rank {len(dims)}, expected {len(spec.dims)}")
        for axis, (dim, want) in enumerate(zip(dims, spec.dims, strict=True)):
            if isinstance(want, int):
                if dim.HasField("dim_value") and dim.dim_value != want:
                    raise ExportError(f"{value.name} axis {axis} is {dim.dim_value}, expected {want}")
                continue
            if dim.HasField("dim_value"):
                raise ExportError(
                    f"axis {want!r} ({value.name} axis {axis}) was specialised to "
                    f"{dim.dim_value} by torch.export; the model would only run at that size"
                )
            if dim.dim_param:
                renamed.setdefault(dim.dim_param, want)
            dim.dim_param = want
    for value in model.graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renamed:
                dim.dim_param = renamed[dim.dim_param]


def _locate_params(model: onnx.ModelProto, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Which initializer holds each parameter (as is, or transposed for MatMul)."""
    from onnx import numpy_helper

    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    found: dict[str, dict[str, Any]] = {}
    for name, tensor in state.items():
        want = tensor.numpy()
        for init_name, array in arrays.items():
            if array.shape == want.shape and np.array_equal(array.astype(np.float32), want):
                found[name] = {"initializer": init_name, "transposed": False}
                break
            if array.ndim == 2 and array.shape == want.T.shape and np.array_equal(
                array.astype(np.float32), want.T
            ):
                found[name] = {"initializer": init_name, "transposed": True}
                break
        else:
            raise ExportError(f"parameter {name} not found among the exported initializers")
    return found


def _post_export_checks(model: onnx.ModelProto, config: MhaConfig, module32: Any) -> list[CheckResult]:
    """onnx.checker, IR version, an ORT session, then parity with the PyTorch reference."""
    from mha_onnx.runtime.ort import OrtRunner

    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        return [CheckResult("onnx.checker", False, str(exc).splitlines()[0])]
    checks = [CheckResult("onnx.checker", True, "full check passed"),
              CheckResult("ir_version", model.ir_version <= MAX_IR_VERSION,
                          f"IR {model.ir_version} (onnxruntime reads <= {MAX_IR_VERSION})")]
    try:
        runner = OrtRunner(model.SerializeToString(), "cpu", threads=2)
        runner.session  # noqa: B018
    except Exception as exc:  # noqa: BLE001 (reported as a failed check)
        return checks + [CheckResult("ort_load", False, str(exc))]
    checks.append(CheckResult("ort_load", True, "ORT CPU session created"))
    with runner:
        checks += _parity_checks(runner, config, module32)
    return checks


def _check_cases(config: MhaConfig) -> list[tuple[ShapeCase, str]]:
    """The shapes checked after export, each with its label."""
    out = []
    if config.kv_cache:
        for batch, seq_q, past in CACHE_CHECK_SHAPES:
            dims = {"batch": batch, "seq_q": seq_q, "past_seq": past}
            out.append((ShapeCase("check", dims, "some"),
                        f"parity (batch={batch}, seq_q={seq_q}, past_seq={past})"))
        return out
    for batch, seq_q, seq_kv in CHECK_SHAPES:
        pads = ("some", "full") if config.mask == "key-padding" and batch > 1 else ("some",)
        for pad in pads:
            shape = f"(batch={batch}, seq_q={seq_q}" + (
                f", seq_kv={seq_kv})" if config.attention == "cross" else ")")
            out.append((ShapeCase("check", {"batch": batch, "seq_q": seq_q, "seq_kv": seq_kv}, pad),
                        f"parity {shape}" + (" fully padded row" if pad == "full" else "")))
    return out


def _parity_checks(runner: Any, config: MhaConfig, module32: Any) -> list[CheckResult]:
    """ORT against the reference at shapes other than the tracing example."""
    from mha_onnx.reference.mha import run_reference
    from mha_onnx.stats import default_tolerance

    atol, rtol = default_tolerance(config.dtype)
    specs = contract_specs(config)
    checks = []
    for n, (case, label) in enumerate(_check_cases(config)):
        feeds = make_inputs(specs, case, seed=1000 + n)
        try:
            got = runner.infer(feeds)
        except Exception as exc:  # noqa: BLE001
            axis = _guess_specialised_axis(str(exc))
            checks.append(CheckResult(label, False, f"ORT failed{axis}: {exc}"))
            continue
        want = run_reference(module32, feeds)
        worst = [compare(got[name], want[name], atol=atol, rtol=rtol) for name in want]
        stats = max(worst, key=lambda st: st.max_abs)
        checks.append(CheckResult(label, all(st.passed for st in worst),
                                  f"max abs {stats.max_abs:.2e} (atol {atol:g})"))
    return checks


def _guess_specialised_axis(message: str) -> str:
    for name in ("batch", "seq_q", "seq_kv"):
        if name in message:
            return f" (axis {name!r} looks specialised)"
    return ""
