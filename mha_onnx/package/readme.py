"""The README of a packaged model repository: how to serve it and send a request."""

from __future__ import annotations

import json
from typing import Any

from mha_onnx.graph.inputs import InputSpec, input_specs, split_dims
from mha_onnx.package.pbtxt import TRITON_TYPES


def serving_readme(model, cfg, batching: dict[str, Any], outputs: list[InputSpec],
                   max_batch: int, serving=None) -> str:
    """How to serve the repository and send a request (written beside the model);
    ``serving``: a KV decoder's stateful plan (decoder.py)."""
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
        *(_stateful(serving, cfg.name) if serving else [
            f"Dynamic batching: {json.dumps(batching) or 'Triton defaults'}; max batch size "
            f"{max_batch}{' (0: the model takes its batch dim itself)' if not max_batch else ''}.",
            "",
            f"Inputs: {example}. A request with `tritonclient` (pip install "
            "'tritonclient[http]'):",
            "",
            "```python",
            "import numpy as np, tritonclient.http as http",
            'client = http.InferenceServerClient("localhost:8000")',
            "inputs = []",
            *[_request_line(s, set(split_dims(specs)[0]), _names(specs)) for s in specs],
            f'result = client.infer("{cfg.name}", inputs)',
            *[f'print(result.as_numpy("{o.name}").shape)' for o in outputs],
            "```"]),
        "",
        "Scaling out: the repository is the unit. Replicas are more Triton servers on the same",
        "repository (a Kubernetes Deployment behind a Service), or KServe's InferenceService with",
        "`modelFormat: onnx` (its ONNX runtime is Triton) pointing `storageUri` at a copy of REPO.",
    ]
    return "\n".join(lines) + "\n"


def _request_line(spec: InputSpec, batch_dims: set, names: set) -> str:
    """One input of the sample request: batch 2, every other named dim 16, and a dim that
    is an expression of them its value (a mask over past + new keys: 32)."""
    from mha_onnx.graph.expressions import evaluate

    sizes = {n: 2 if n in batch_dims else 16 for n in names}
    shape = [d if isinstance(d, int) else sizes.get(d) or evaluate(d, sizes) or 16
             for d in spec.dims]
    triton = TRITON_TYPES[spec.dtype.name].removeprefix("TYPE_")
    data = (f"np.zeros({shape}, dtype=np.{spec.dtype.name})" if spec.role != "data"
            else f"np.random.rand(*{shape}).astype(np.{spec.dtype.name})")
    return (f'inputs.append(http.InferInput("{spec.name}", {shape}, "{triton}")); '
            f"inputs[-1].set_data_from_numpy({data})")


def _names(specs: list[InputSpec]) -> set:
    """The plain dim names (not expressions) of the inputs."""
    return {d for s in specs for d in s.dims if isinstance(d, str) and d.isidentifier()}


def _stateful(serving, name: str) -> list[str]:
    """A KV decoder's README part: the state contract and a client loop that runs."""
    from mha_onnx.package.decoder import decoder_request

    iface = serving.iface
    first = ("one position of zeros that the client's attention_mask hides with a leading 0 "
             "(mask = [0] + [1] * tokens so far)" if serving.hidden_position else
             f"its buffer of {serving.initial_length} positions, zeros")
    return [
        "A decoder with a KV cache, served statefully: sequence batching keeps each "
        f"sequence's cache on the server (one implicit state per past: {len(iface.pasts)} "
        "states). A request sends the new tokens, their positions and the whole "
        "attention_mask, with `sequence_id` (one per conversation) and `sequence_start` on "
        f"the first request; the reply is the logits. A sequence's cache starts as {first}. "
        "One sequence per batch slot (max batch size 1); `--instances` serves more at once. "
        "What Triton cannot do here: batch the steps of sequences at different lengths (the "
        "model takes one past length per run), or let a sequence join a running batch "
        "between steps; for many users at once on one decoder, `mha-onnx serve` batches "
        "every running sequence into each decode step. "
        "A greedy loop with `tritonclient` (pip install 'tritonclient[http]'):",
        "",
        "```python",
        *decoder_request(serving, name, [1, 2, 3, 4, 5], 8),
        "```",
    ]
