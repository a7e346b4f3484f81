"""``package``: a checked model as a Triton Inference Server model repository (onnxruntime
backend), the artefact NVIDIA's Model Navigator emits and KServe serves:

    REPO/NAME/config.pbtxt          the first target's config
    REPO/NAME/configs/<target>.pbtxt one per target (Triton's --model-config-name)
    REPO/NAME/1/model.onnx          (+ model.onnx.data)
    REPO/NAME/README.md             how to serve it and send a request

Configs carry the inputs and outputs with their types and -1 for every dynamic dim (the
batch dim left out when ``max_batch_size`` > 0), dynamic batching (preferred sizes and queue
delay from a profile when given), instance groups, thread counts, the graph optimisation
level the model needs (recorded by fuse when the default crashes ORT) and, for TensorRT,
FP16, an engine cache and optimisation-profile shapes derived from the dynamic dims.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.errors import ConfigError
from mha_onnx.graphio import external_files, prepare_folder, read_model
from mha_onnx.input_roles import all_nodes
from mha_onnx.inputs import InputSpec, input_specs, split_dims
from mha_onnx.metadata import session_options
from mha_onnx.table import table

TARGETS = ("cpu", "cuda", "tensorrt", "openvino")  # openvino: Triton's OpenVINO backend, CPU
TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "float64": "TYPE_FP64",
                "bool": "TYPE_BOOL", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
                "int8": "TYPE_INT8", "uint8": "TYPE_UINT8"}
# Triton's onnxruntime backend: optimization.graph.level (-1 basic, 1 extended, 2 none;
# absent: all, ORT's default).
GRAPH_LEVELS = {"basic": -1, "extended": 1, "none": 2}


@dataclass(frozen=True)
class PackageConfig:
    name: str = "attention"
    max_batch_size: int = 8
    targets: tuple[str, ...] = ("cpu",)
    instances: int = 1
    from_profile: str | None = None
    lengths: tuple[int, int, int] = (1, 128, 2048)  # min, opt, max length for TensorRT
    force: bool = False

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "_-." for c in self.name):
            raise ConfigError(f"model name {self.name!r} is not a valid Triton model name",
                              hint="use letters, digits, '_', '-' and '.'")
        if self.max_batch_size < 0 or self.instances < 1:
            raise ConfigError("--max-batch-size must be >= 0 and --instances >= 1")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ConfigError(f"unknown target(s) {', '.join(unknown) or '(none)'}",
                              hint=f"targets: {', '.join(TARGETS)}")
        low, opt, high = self.lengths
        if not 1 <= low <= opt <= high:
            raise ConfigError("lengths must satisfy 1 <= min <= opt <= max")


@dataclass(frozen=True)
class PackageReport:
    repository: str
    name: str
    files: tuple[str, ...]
    configs: dict[str, str]  # target -> config text
    batching: dict[str, Any]
    seconds: float
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"repository": self.repository, "name": self.name, "files": list(self.files),
                "targets": list(self.configs), "batching": self.batching,
                "notes": list(self.notes), "seconds": round(self.seconds, 3)}

    def render(self) -> str:
        rows = [(f, ) for f in self.files]
        return "\n".join([f"packaged {self.name} into {self.repository} for "
                          f"{', '.join(self.configs)} in {self.seconds:.1f} s",
                          f"  dynamic batching: {json.dumps(self.batching)}",
                          *(f"  note: {n}" for n in self.notes),
                          table(["file"], rows, indent="  ")])


# -- the config ----------------------------------------------------------------------------------

def _tensor(spec: InputSpec, batched: bool) -> dict[str, Any]:
    dims = [d if isinstance(d, int) else -1 for d in spec.dims]
    if batched:
        dims = dims[1:]
    entry: dict[str, Any] = {"name": spec.name, "data_type": TRITON_TYPES[spec.dtype.name],
                             "dims": dims or [1]}
    if not dims:  # a scalar (a shared cache's past_sequence_length): Triton wants a dim
        entry["reshape"] = {"shape": []}
    return entry


def _outputs(model) -> list[InputSpec]:
    from mha_onnx.inputs import NP_TYPES

    specs = []
    for value in model.graph.output:
        tensor = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in tensor.shape.dim)
        specs.append(InputSpec(value.name, np.dtype(NP_TYPES[tensor.elem_type]), dims))
    return specs


def _batchable(inputs: list[InputSpec], outputs: list[InputSpec]) -> bool:
    """Every input and output has the batch dim first (Triton then owns it)."""
    batch = set(split_dims(inputs)[0])
    return bool(batch) and all(spec.dims and spec.dims[0] in batch for spec in inputs + outputs)


def batching_from_profile(path: str | None, max_batch: int) -> dict[str, Any]:
    """Preferred batch sizes: the profiled batch sizes (<= max) whose throughput is within
    10 % of the best; queue delay: 10 % of the p50 latency at the smallest of them. Without
    a profile: Triton's defaults (no preferred sizes, no delay)."""
    if not path:
        return {}
    data = json.loads(Path(path).read_text())
    best: dict[int, float] = {}
    latency: dict[int, float] = {}
    for point in data.get("points", []):
        if point.get("error") or point["batch"] > max_batch:
            continue
        b = int(point["batch"])
        if point["tokens_per_s"] >= best.get(b, 0.0):
            best[b], latency[b] = point["tokens_per_s"], point["p50_ms"]
    if not best:
        raise ConfigError(f"{path} has no usable point at batch <= {max_batch}")
    if len(best) < 2:  # one batch size measured says nothing about batching
        return {}
    top = max(best.values())
    preferred = sorted(b for b, v in best.items() if v >= 0.9 * top and b > 1) or [max(best)]
    return {"preferred_batch_size": preferred,
            "max_queue_delay_microseconds": int(100 * latency[preferred[0]])}


def _profile_shapes(specs: list[InputSpec], cfg: PackageConfig, batch: int) -> dict[str, str]:
    """TensorRT optimisation profile: min/opt/max per input (batch dims from 1 to the max
    batch size, length dims over ``cfg.lengths``)."""
    shapes: dict[str, list[str]] = {"min": [], "opt": [], "max": []}
    low, opt, high = cfg.lengths
    batch_dims = set(split_dims(specs)[0])
    for spec in specs:
        for kind, (b, n) in (("min", (1, low)), ("opt", (batch, opt)),
                             ("max", (max(1, cfg.max_batch_size), high))):
            dims = [d if isinstance(d, int) else (b if d in batch_dims else n)
                    for d in spec.dims]
            shapes[kind].append(f"{spec.name}:{'x'.join(str(d) for d in dims)}")
    return {f"trt_profile_{k}_shapes": ",".join(v) for k, v in shapes.items()}


def triton_config(model, cfg: PackageConfig, target: str, batching: dict[str, Any],
                  threads: int = 0) -> dict[str, Any]:
    """The model config of one target as nested dicts/lists (Triton's ModelConfig)."""
    inputs, outputs = input_specs(model), _outputs(model)
    batched = cfg.max_batch_size > 0 and _batchable(inputs, outputs)
    config: dict[str, Any] = {
        "name": cfg.name, "backend": "openvino" if target == "openvino" else "onnxruntime",
        "max_batch_size": cfg.max_batch_size if batched else 0,
        "input": [_tensor(s, batched) for s in inputs],
        "output": [_tensor(s, batched) for s in outputs],
        "instance_group": [{"count": cfg.instances,
                            "kind": "KIND_GPU" if target in ("cuda", "tensorrt") else "KIND_CPU"}],
    }
    if batched:
        config["dynamic_batching"] = dict(batching)
    if target == "openvino":  # the backend's own parameters; it reads model.onnx directly
        config["default_model_filename"] = "model.onnx"
        config["parameters"] = {"PERFORMANCE_HINT": {"string_value": "LATENCY"},
                                "NUM_STREAMS": {"string_value": "1"},
                                **({"INFERENCE_NUM_THREADS": {"string_value": str(threads)}}
                                   if threads else {})}
        return config
    optimization: dict[str, Any] = {}
    level = session_options(model).get("optimization", "all")
    if level in GRAPH_LEVELS:
        optimization["graph"] = {"level": GRAPH_LEVELS[level]}
    if target == "tensorrt":
        opt_batch = (batching.get("preferred_batch_size") or [1])[0]
        params = {"precision_mode": "FP16", "trt_engine_cache_enable": "1",
                  "trt_engine_cache_path": f"/tmp/triton_trt_cache/{cfg.name}",
                  **_profile_shapes(inputs, cfg, opt_batch)}
        optimization["execution_accelerators"] = {"gpu_execution_accelerator": [
            {"name": "tensorrt", "parameters": params}]}
    if optimization:
        config["optimization"] = optimization
    config["parameters"] = {"intra_op_thread_count": {"string_value": str(threads)},
                            "inter_op_thread_count": {"string_value": "1"}}
    return config


def to_pbtxt(message: dict[str, Any], indent: int = 0) -> str:
    """Protobuf text format of nested dicts (messages), lists (repeated fields) and scalars;
    a dict under a map field is written as repeated {key, value} entries."""
    pad = "  " * indent
    lines = []
    for key, value in message.items():
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and all(not isinstance(v, dict) for v in value):
            lines.append(f"{pad}{key}: [ {', '.join(_scalar(v, key) for v in value)} ]")
            continue
        for item in items:
            if key == "parameters" and isinstance(item, dict):
                for k, v in item.items():
                    body = to_pbtxt({"value": v}, indent + 1) if isinstance(v, dict) else \
                        f"{'  ' * (indent + 1)}value: {_scalar(v, 'value')}"
                    lines.append(f'{pad}{key} {{\n{"  " * (indent + 1)}key: "{k}"\n{body}\n{pad}}}')
            elif isinstance(item, dict):
                lines.append(f"{pad}{key} {{\n{to_pbtxt(item, indent + 1)}\n{pad}}}")
            else:
                lines.append(f"{pad}{key}: {_scalar(item, key)}")
    return "\n".join(lines)


ENUM_FIELDS = {"data_type", "kind"}


def _scalar(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if key in ENUM_FIELDS:
        return str(value)
    return json.dumps(str(value))


# -- the repository -------------------------------------------------------------------------------

def package_notes(model, cfg: PackageConfig, batching: dict[str, Any]
                  ) -> tuple[PackageConfig, list[str]]:
    """What a deployment must know: ORT-only ops under a TensorRT target, a TensorRT
    profile longer than the model's position table (capped), batching left at Triton's
    defaults for want of measured batch sizes."""
    notes = []
    if "tensorrt" in cfg.targets:
        counts: dict[str, int] = {}
        for node in all_nodes(model.graph):  # inside If branches too
            if node.domain not in ("", "ai.onnx") or node.op_type in ("If", "Loop", "Scan"):
                label = f"{node.domain + '.' if node.domain else ''}{node.op_type}"
                counts[label] = counts.get(label, 0) + 1
        if counts:
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
            notes.append(f"tensorrt: TensorRT builds no engine for {ops}; ONNX Runtime runs "
                         "them on CUDA between the TensorRT engines (fuse --ep tensorrt picks "
                         "the forms measured on CUDA, with fewer If guards)")
    limit = min((s.bound for s in input_specs(model) if s.role == "ids"
                 and "position" in s.name.lower()), default=None)
    if limit is not None and cfg.lengths[2] > limit:
        low, opt, _ = cfg.lengths
        cfg = replace(cfg, lengths=(min(low, limit), min(opt, limit), limit))
        notes.append(f"lengths capped at {limit}, the model's position table")
    if "openvino" in cfg.targets:
        notes += openvino_notes(model.SerializeToString(), input_specs(model))
    if cfg.from_profile and not batching:
        notes.append(f"{cfg.from_profile} measured one batch size: dynamic batching is left "
                     "at Triton's defaults (profile --batch 1,4,8 to choose it)")
    return cfg, notes


def openvino_notes(model: bytes, specs: list[InputSpec]) -> list[str]:
    """The model compiled on OpenVINO here (else the target is refused with its reason), and
    what Triton's OpenVINO backend documents that a deployment must know."""
    from mha_onnx.runtime_openvino import OpenVinoRunner
    from mha_onnx.runtimes import ProviderUnavailableError

    notes = []
    try:
        with OpenVinoRunner(model, "openvino-bf16") as runner:
            precision = runner.precision
    except ProviderUnavailableError as exc:
        if "not installed" in str(exc):
            return [f"openvino: not checked here ({exc}); validate --providers openvino "
                    "before serving"]
        raise
    if precision and precision != "f32":
        notes.append(f"openvino: OpenVINO's default precision on this CPU is {precision} and "
                     "the backend documents no f32 setting: float32 outputs change (validate "
                     "--providers openvino-bf16 says by how much)")
    if any(not s.dims for s in specs):
        notes.append("openvino: the backend does not take scalar inputs (its known issues): "
                     + ", ".join(s.name for s in specs if not s.dims))
    return notes


def package_model(source: str | Path, repository: str | Path, cfg: PackageConfig) -> PackageReport:
    """Write the model repository (refusing a non-empty model folder without ``force``)."""
    started = time.perf_counter()
    model = read_model(source)
    folder = prepare_folder(Path(repository) / cfg.name, force=cfg.force)
    batching = batching_from_profile(cfg.from_profile, cfg.max_batch_size)
    cfg, notes = package_notes(model, cfg, batching)
    threads = _best_threads(cfg.from_profile)
    configs = {t: to_pbtxt(triton_config(model, cfg, t, batching,
                                         threads if t in ("cpu", "openvino") else 0))
               + "\n" for t in cfg.targets}
    version = folder / "1"
    version.mkdir(exist_ok=True)
    files = [_copy(source, version / "model.onnx")]
    for data in external_files(read_model(source, load_external_data=False), source):
        files.append(_copy(data, version / data.name))
    (folder / "configs").mkdir(exist_ok=True)
    for target, text in configs.items():
        files.append(_write(folder / "configs" / f"{target}.pbtxt", text))
    files.append(_write(folder / "config.pbtxt", configs[cfg.targets[0]]))
    files.append(_write(folder / "README.md", serving_readme(model, cfg, batching)))
    return PackageReport(str(repository), cfg.name, tuple(str(f) for f in files), configs,
                         batching, time.perf_counter() - started, tuple(notes))


def _copy(src: str | Path, dst: Path) -> Path:
    from mha_onnx.graphio import write_bytes

    write_bytes(Path(src).read_bytes(), dst, force=True)
    return dst


def _write(path: Path, text: str) -> Path:
    from mha_onnx.graphio import write_bytes

    write_bytes(text.encode(), path, force=True)
    return path


def _best_threads(path: str | None) -> int:
    """The profile's best CPU thread count overall (0: let ORT choose)."""
    if not path:
        return 0
    best = json.loads(Path(path).read_text()).get("best_threads") or []
    cpu = [b for b in best if b.get("provider") == "cpu"]
    if not cpu:
        return 0
    counts = [b["threads"] for b in cpu]
    return max(set(counts), key=counts.count)


def serving_readme(model, cfg: PackageConfig, batching: dict[str, Any]) -> str:
    """How to serve the repository and send a request (written beside the model)."""
    specs = input_specs(model)
    example = ", ".join(f'"{s.name}": {s.dtype.name}[{", ".join(str(d) for d in s.dims)}]'
                        for s in specs)
    gpus = "--gpus=all " if any(t != "cpu" for t in cfg.targets) else ""
    lines = [
        f"# {cfg.name}: served by Triton Inference Server ("
        + ", ".join(f"{b} backend" for b in dict.fromkeys(
            "openvino" if t == "openvino" else "onnxruntime" for t in cfg.targets)) + ")",
        "",
        "Written by `mha-onnx package`. Serve the repository with NVIDIA's Triton container",
        "whose onnxruntime backend is built with ONNX Runtime 1.31 (the release notes'",
        "framework matrix lists the ORT version of each `nvcr.io/nvidia/tritonserver:<YY.MM>-py3`",
        "image; pick that tag for TRITON_IMAGE):",
        "",
        "```sh",
        f"docker run --rm {gpus}-p8000:8000 -p8001:8001 -p8002:8002 \\",
        "  -v $PWD/REPO:/models $TRITON_IMAGE \\",
        f"  tritonserver --model-repository=/models --model-control-mode=explicit "
        f"--load-model={cfg.name}",
        "```",
        "",
        f"Targets: {', '.join(cfg.targets)}; `config.pbtxt` is the {cfg.targets[0]} config. Another "
        "one is selected with `--model-config-name=<target>` (files in `configs/`).",
        f"Dynamic batching: {json.dumps(batching) or 'Triton defaults'}; max batch size "
        f"{cfg.max_batch_size}.",
        "",
        f"Inputs: {example}. A request with `tritonclient` (pip install 'tritonclient[http]'):",
        "",
        "```python",
        "import numpy as np, tritonclient.http as http",
        'client = http.InferenceServerClient("localhost:8000")',
        "inputs = []",
        *[_request_line(s, set(split_dims(specs)[0])) for s in specs],
        f'result = client.infer("{cfg.name}", inputs)',
        *[f'print(result.as_numpy("{o.name}").shape)' for o in _outputs(model)],
        "```",
        "",
        "Scaling out: the repository is the unit. Replicas are more Triton servers on the same",
        "repository (a Kubernetes Deployment behind a Service), or KServe's InferenceService with",
        "`modelFormat: onnx` (its ONNX runtime is Triton) pointing `storageUri` at a copy of REPO.",
    ]
    return "\n".join(lines) + "\n"


def _request_line(spec: InputSpec, batch_dims: set) -> str:
    shape = [d if isinstance(d, int) else (2 if d in batch_dims else 16) for d in spec.dims]
    triton = TRITON_TYPES[spec.dtype.name].removeprefix("TYPE_")
    data = (f"np.zeros({shape}, dtype=np.{spec.dtype.name})" if spec.role != "data"
            else f"np.random.rand(*{shape}).astype(np.{spec.dtype.name})")
    return (f'inputs.append(http.InferInput("{spec.name}", {shape}, "{triton}")); '
            f"inputs[-1].set_data_from_numpy({data})")
