"""The README of a packaged model repository: how to serve it and send a request."""

from __future__ import annotations

import json
from typing import Any

from mha_onnx.inputs import InputSpec, input_specs, split_dims

TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "float64": "TYPE_FP64",
                "bool": "TYPE_BOOL", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
                "int8": "TYPE_INT8", "uint8": "TYPE_UINT8"}


def serving_readme(model, cfg, batching: dict[str, Any], outputs: list[InputSpec]) -> str:
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
        *(["A model of their own (tuned there, `mha-onnx tune`): "
           + ", ".join(f"{t} loads `1/model.{t}.onnx`" for t, _ in cfg.target_models)
           + " (its config's `default_model_filename`); the others `1/model.onnx`."]
          if cfg.target_models else []),
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
        *[f'print(result.as_numpy("{o.name}").shape)' for o in outputs],
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
