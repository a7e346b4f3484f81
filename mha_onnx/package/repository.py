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
from mha_onnx.graph.files import external_files, prepare_folder, read_model
from mha_onnx.graph.inputs import InputSpec, input_specs, split_dims
from mha_onnx.graph.metadata import session_options
from mha_onnx.graph.walk import all_nodes
from mha_onnx.package.pbtxt import TRITON_TYPES, to_pbtxt
from mha_onnx.package.readme import serving_readme
from mha_onnx.table import table

TARGETS = ("cpu", "cuda", "tensorrt", "openvino")  # openvino: Triton's OpenVINO backend, CPU
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
    # target -> a model of its own for it (one tuned there: `mha-onnx tune`), else the model
    target_models: tuple[tuple[str, str], ...] = ()
    stateless: bool = False  # a KV decoder served as any model: the client sends the cache

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
        stray = [t for t, _ in self.target_models if t not in self.targets]
        if stray:
            raise ConfigError(f"--target-model for {', '.join(stray)}, which is not a --target",
                              hint="add the --target, or drop its --target-model")
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
                          "  dynamic batching: " + (json.dumps(self.batching) if self.batching
                                                    else "none (sequence batching, or batch "
                                                         "size 0)"),
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
    from mha_onnx.graph.inputs import NP_TYPES

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
    from mha_onnx.runtime.openvino import OpenVinoRunner
    from mha_onnx.runtime.ort import ProviderUnavailableError

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
    from mha_onnx.package.decoder import decoder_notes, decoder_serving, stateful_config

    started = time.perf_counter()
    model = read_model(source)
    own = {t: (p, _same_interface(model, p, t)) for t, p in cfg.target_models}
    serving = None if cfg.stateless else decoder_serving(model, cfg.lengths[2])  # stateful
    batching = {} if serving else batching_from_profile(cfg.from_profile, cfg.max_batch_size)
    cfg, notes = package_notes(model, cfg, batching)
    notes += decoder_notes(serving) if serving else []
    threads = _best_threads(cfg.from_profile)
    configs, batch = {}, {}
    for t in cfg.targets:
        config = stateful_config(serving, cfg, t, threads if t == "cpu" else 0) if serving \
            else triton_config(own[t][1] if t in own else model, cfg, t, batching,
                               threads if t in ("cpu", "openvino") else 0)
        if t in own:  # Triton loads this file for this config
            config["default_model_filename"] = f"model.{t}.onnx"
            notes.append(f"{t}: 1/model.{t}.onnx ({_tuned_where(own[t][1])})")
        configs[t], batch[t] = to_pbtxt(config) + "\n", config["max_batch_size"]
    folder = prepare_folder(Path(repository) / cfg.name, force=cfg.force)
    version = folder / "1"
    version.mkdir(exist_ok=True)
    files = [_copy(source, version / "model.onnx")]
    files += _copy_data(source, version, set())
    for target, (path, _) in own.items():
        files.append(_copy(path, version / f"model.{target}.onnx"))
        files += _copy_data(path, version, {f.name for f in files})
    (folder / "configs").mkdir(exist_ok=True)
    for target, text in configs.items():
        files.append(_write(folder / "configs" / f"{target}.pbtxt", text))
    files.append(_write(folder / "config.pbtxt", configs[cfg.targets[0]]))
    files.append(_write(folder / "README.md", serving_readme(
        model, cfg, batching, _outputs(model), batch[cfg.targets[0]], serving)))
    return PackageReport(str(repository), cfg.name, tuple(str(f) for f in files), configs,
                         batching, time.perf_counter() - started, tuple(notes))


def _same_interface(model, path: str, target: str):
    """The model given for ``target``, refused unless its inputs and outputs are the
    model's (one client serves every target)."""
    other = read_model(path)
    mine = ([(s.name, s.dtype, s.dims) for s in input_specs(model)],
            [(s.name, s.dtype, s.dims) for s in _outputs(model)])
    theirs = ([(s.name, s.dtype, s.dims) for s in input_specs(other)],
              [(s.name, s.dtype, s.dims) for s in _outputs(other)])
    if mine != theirs:
        raise ConfigError(f"--target-model {target}={path} has other inputs or outputs than "
                          "the model", hint="give a model tuned or fused from the same one")
    return other


def _tuned_where(model) -> str:
    """Where a target's model was tuned, from its tuning record."""
    from mha_onnx.graph import metadata

    tuning = metadata.loaded(model, "tuning")
    if not tuning:
        return "not tuned"
    machine = tuning.get("machine", {})
    return (f"tuned on {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
            f"onnxruntime {machine.get('onnxruntime', '?')}, "
            f"{machine.get('threads') or 'default'} threads: {tuning.get('runs', '?')}")


def _copy_data(source: str | Path, version: Path, taken: set[str]) -> list[Path]:
    """The external data files of ``source`` beside its copy (refused where another model
    of the repository already has a file of that name)."""
    out = []
    for data in external_files(read_model(source, load_external_data=False), source):
        if data.name in taken:
            raise ConfigError(f"{source}'s external data {data.name} has the name of another "
                              "file of the repository",
                              hint="save that model with another data file name")
        out.append(_copy(data, version / data.name))
    return out


def _copy(src: str | Path, dst: Path) -> Path:
    from mha_onnx.graph.files import write_bytes

    write_bytes(Path(src).read_bytes(), dst, force=True)
    return dst


def _write(path: Path, text: str) -> Path:
    from mha_onnx.graph.files import write_bytes

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
