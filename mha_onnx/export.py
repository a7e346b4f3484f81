"""Export of the reference to ONNX with truly dynamic batch and sequence axes, checked.

The exported graph follows the contract of :func:`mha_onnx.config.graph_inputs`; its
metadata_props carry the config, the package version, the weights' checksum and where each
parameter lives, so later stages can rebuild the PyTorch reference from the file alone.
Nothing is written unless every post-export check passed.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mha_onnx import __version__
from mha_onnx.config import MhaConfig, TensorSpec, graph_inputs, graph_outputs
from mha_onnx.errors import ExportError
from mha_onnx.graphio import MAX_IR_VERSION, MAX_OPSET, prepare_output, write_model
from mha_onnx.stats import compare
from mha_onnx.table import human_bytes, table

log = logging.getLogger(__name__)

META_PREFIX = "mha_onnx."
DEFAULT_OPSET = 20
MIN_OPSET = 18
# Example sizes for tracing: >= 2 and pairwise distinct so torch.export keeps them symbolic.
EXAMPLE_BATCH, EXAMPLE_SEQ_Q, EXAMPLE_SEQ_KV = 2, 5, 7
# (batch, seq_q, seq_kv) checked after export; none equals the example.
CHECK_SHAPES = ((1, 1, 1), (1, 13, 6), (3, 37, 41), (2, 64, 3))


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


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
    from mha_onnx.reference import MultiHeadAttention

    cross, padded = config.attention == "cross", config.mask == "key-padding"

    class Exportable(MultiHeadAttention):
        if cross and padded:

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


def make_feeds(
    config: MhaConfig, batch: int, seq_q: int, seq_kv: int, *, seed: int = 0, pad: str = "some"
) -> dict[str, np.ndarray]:
    """Random inputs of the contract. ``pad``: "none", "some" (every row keeps >= 1 key) or
    "full" (the last batch entry has every key padded)."""
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(config.dtype)
    seq_kv = seq_kv if config.attention == "cross" else seq_q
    feeds: dict[str, np.ndarray] = {}
    for spec in graph_inputs(config):
        if spec.name == "key_padding_mask":
            mask = np.zeros((batch, seq_kv), dtype=bool)
            if pad in ("some", "full"):
                for b in range(batch):
                    keep = int(rng.integers(1, seq_kv + 1))
                    mask[b, keep:] = True
                    mask[b, rng.random(seq_kv) < 0.2] = True
                    mask[b, int(rng.integers(0, seq_kv))] = False
            if pad == "full":
                mask[-1, :] = True
            feeds[spec.name] = mask
        else:
            length = seq_q if spec.name == "query" else seq_kv
            feeds[spec.name] = rng.standard_normal((batch, length, config.d_model)).astype(np_dtype)
    return feeds


def reference_outputs(module32: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The float32 reference module's output for ``feeds`` (float inputs upcast)."""
    import torch

    args = {k: torch.from_numpy(v) for k, v in feeds.items()}
    for name in ("query", "key", "value"):
        if name in args:
            args[name] = args[name].float()
    with torch.no_grad():
        out = module32(
            args["query"], args.get("key"), args.get("value"), args.get("key_padding_mask")
        )
    return out.numpy()


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

    from mha_onnx.reference import TORCH_DTYPES, build_reference
    from mha_onnx.weights import checksum, load_weights

    started = time.perf_counter()
    opset = DEFAULT_OPSET if opset is None else opset
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"opset {opset} is not supported", hint=f"use {MIN_OPSET}..{MAX_OPSET}")
    output = prepare_output(output, force=force)
    state = load_weights(weights, config) if weights is not None else None
    module32 = build_reference(config.replace(dtype="float32"), state, seed=seed)
    source = f"file:{Path(weights).name}" if weights is not None else f"random(seed={seed})"
    state32 = {k: v.detach().clone() for k, v in module32.state_dict().items()}
    if config.dtype != "float32":  # the reference then holds exactly the exported weights
        state32 = {k: v.to(TORCH_DTYPES[config.dtype]).float() for k, v in state32.items()}
        module32.load_state_dict(state32)
    digest = checksum(state32)

    exportable = _exportable(config)(config)
    exportable.load_state_dict(state32)
    exportable = exportable.to(TORCH_DTYPES[config.dtype]).eval()
    model = _torch_export(exportable, config, opset)
    _name_dims(model, config)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    params = _locate_params(model, state32)
    meta = {
        "version": __version__,
        "config": config.to_json(),
        "weights_sha256": digest,
        "weights_source": source,
        "params": json.dumps(params, sort_keys=True),
    }
    del model.metadata_props[:]
    for key, value in meta.items():
        model.metadata_props.add(key=META_PREFIX + key, value=value)
    model.producer_name, model.producer_version = "mha-onnx", __version__

    checks = _post_export_checks(model, config, module32)
    failed = [c for c in checks if not c.passed]
    if failed:
        raise ExportError(
            f"post-export check {failed[0].name!r} failed: {failed[0].detail}",
            hint="nothing was written; run with -v for details",
        )
    write_model(model, output, force=force)
    return ExportReport(
        path=str(output),
        config=config,
        opset=opset,
        ir_version=model.ir_version,
        inputs=graph_inputs(config),
        outputs=graph_outputs(config),
        weights_sha256=digest,
        weights_source=source,
        file_bytes=output.stat().st_size,
        seconds=time.perf_counter() - started,
        checks=tuple(checks),
    )


def _torch_export(module: Any, config: MhaConfig, opset: int) -> onnx.ModelProto:
    import torch

    dtype = module.w_q.weight.dtype
    batch = torch.export.Dim("batch", min=1)
    seq_q = torch.export.Dim("seq_q", min=1)
    seq_kv = torch.export.Dim("seq_kv", min=1) if config.attention == "cross" else seq_q
    dim_of = {"batch": batch, "seq_q": seq_q, "seq_kv": seq_kv}
    sizes = {"batch": EXAMPLE_BATCH, "seq_q": EXAMPLE_SEQ_Q, "seq_kv": EXAMPLE_SEQ_KV}
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
                output_names=["output"],
                opset_version=opset,
                optimize=True,
                verbose=False,
                report=False,
            )
    except Exception as exc:  # torch raises many types here; all mean the export failed
        log.debug("torch.onnx output:\n%s", sink.getvalue())
        raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}") from exc
    return program.model_proto


def _name_dims(model: onnx.ModelProto, config: MhaConfig) -> None:
    """Give the contract's dim names to the graph's inputs and outputs; a dynamic axis that
    torch specialised to a number is an error naming the axis."""
    specs = {s.name: s for s in graph_inputs(config) + graph_outputs(config)}
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
            dim.dim_param = want


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
    from mha_onnx.runtimes import OrtRunner
    from mha_onnx.stats import default_tolerance

    checks: list[CheckResult] = []
    try:
        onnx.checker.check_model(model, full_check=True)
        checks.append(CheckResult("onnx.checker", True, "full check passed"))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        checks.append(CheckResult("onnx.checker", False, str(exc).splitlines()[0]))
        return checks
    checks.append(
        CheckResult(
            "ir_version",
            model.ir_version <= MAX_IR_VERSION,
            f"IR {model.ir_version} (onnxruntime reads <= {MAX_IR_VERSION})",
        )
    )
    try:
        runner = OrtRunner(model.SerializeToString(), "cpu", threads=2)
        runner.session  # noqa: B018
        checks.append(CheckResult("ort_load", True, "ORT CPU session created"))
    except Exception as exc:  # noqa: BLE001 (reported as a failed check)
        checks.append(CheckResult("ort_load", False, str(exc)))
        return checks
    atol, rtol = default_tolerance(config.dtype)
    worst = 0.0
    for batch, seq_q, seq_kv in CHECK_SHAPES:
        pads = ("some", "full") if config.mask == "key-padding" and batch > 1 else ("some",)
        for pad in pads:
            feeds = make_feeds(config, batch, seq_q, seq_kv, seed=batch * 1000 + seq_q, pad=pad)
            shape = f"(batch={batch}, seq_q={seq_q}" + (
                f", seq_kv={seq_kv})" if config.attention == "cross" else ")"
            )
            try:
                got = runner.infer(feeds)["output"]
            except Exception as exc:  # noqa: BLE001
                axis = _guess_specialised_axis(str(exc))
                checks.append(CheckResult(f"parity {shape}", False, f"ORT failed{axis}: {exc}"))
                continue
            want = reference_outputs(module32, feeds)
            stats = compare(got, want, atol=atol, rtol=rtol)
            worst = max(worst, stats.max_abs)
            label = f"parity {shape}" + (" fully padded row" if pad == "full" else "")
            checks.append(
                CheckResult(label, stats.passed, f"max abs {stats.max_abs:.2e} (atol {atol:g})")
            )
    runner.close()
    log.info("export parity: worst max abs error %.3g", worst)
    return checks


def _guess_specialised_axis(message: str) -> str:
    for name in ("batch", "seq_q", "seq_kv"):
        if name in message:
            return f" (axis {name!r} looks specialised)"
    return ""
