"""The inputs `quantize` runs a model on: a decoder's prompt runs (random ids, the user's
--eval-prompts, --calibration's windows), generated inputs for any other model, and one
session's outputs on them."""

from __future__ import annotations

import numpy as np
import onnx

from mha_onnx.errors import ConfigError
from mha_onnx.quantize import accuracy, calibrated

EVAL_LENGTH = 128  # the tokens of an --eval-prompts prompt measured (its first)


def session_outputs(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]):
    from mha_onnx.runtime.ort import OrtRunner

    source = model if isinstance(model, str) else model.SerializeToString()
    with OrtRunner(source) as runner:
        return runner.infer({k: v for k, v in feeds.items() if k in runner.input_names})


def decoder_feeds(model: onnx.ModelProto, path: str, batch: int, length: int, seed: int):
    """A decoder's prompt run: (feeds, prompts) for ``batch`` random prompts of ``length``
    (fewer where a position table ends first), empty pasts of the cache's form."""
    from mha_onnx.generate import read_interface

    iface = read_interface(model, path)
    if iface.position_limit:
        length = min(length, iface.position_limit // 2)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, iface.vocab, (batch, length)).tolist()
    return prompt_feeds(iface, prompts), prompts


def prompt_feeds(iface, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """``prompts`` (of one length) as one run of the decoder ``iface`` describes, with
    empty pasts of its cache's form."""
    from mha_onnx.generate import prompt_feeds

    feeds = prompt_feeds(prompts, iface, 0)
    size = len(prompts[0]) if iface.shared else 0
    for past, _ in iface.pasts:
        feeds[past] = np.zeros((len(prompts), iface.kv_heads_of(past), size,
                                iface.head_of(past)), iface.kv_dtype)
    if iface.length_input:
        feeds["past_sequence_length"] = np.array(0, np.int64)
    return feeds


def generic_feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    from mha_onnx.graph.inputs import case_for, input_specs, make_inputs

    specs = input_specs(model)
    return make_inputs(specs, case_for(specs, "accuracy", 2, [64], "none"), seed=seed)


def is_decoder(model: onnx.ModelProto, path: str) -> bool:
    from mha_onnx.generate import read_interface

    try:
        read_interface(model, path)
    except ConfigError:
        return False
    return True


def eval_feeds(model: onnx.ModelProto, path: str, prompts: list[list[int]]):
    """``prompts`` (--eval-prompts) as the measure's batch: (feeds, prompts), each prompt
    cut to the shortest one's length, at most EVAL_LENGTH tokens."""
    from mha_onnx.generate import read_interface

    iface = read_interface(model, path)
    check_prompts(iface, prompts, "--eval-prompts", run_whole=False)  # (cut below)
    length = min(EVAL_LENGTH, *(len(p) for p in prompts),
                 *([iface.position_limit // 2] if iface.position_limit else []))
    if length < accuracy.GREEDY_FROM:
        raise ConfigError(f"--eval-prompts: a prompt of {length} tokens",
                          hint=f"{accuracy.GREEDY_FROM} or more each (greedy generation "
                               "starts from their first tokens)")
    cut = [p[:length] for p in prompts]
    return prompt_feeds(iface, cut), cut


def check_prompts(iface, prompts: list[list[int]], option: str = "--kv-calibration",
                   run_whole: bool = True) -> None:
    """Every token id in the vocabulary; with ``run_whole`` (the prompts are not cut to
    fit: --kv-calibration's), every prompt within the position table."""
    for n, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < iface.vocab]
        if bad:
            raise ConfigError(f"{option} prompt {n} has token id(s) outside the "
                              f"vocabulary of {iface.vocab}: {bad[:5]}")
        if run_whole and iface.position_limit and len(prompt) > iface.position_limit:
            raise ConfigError(f"{option} prompt {n} ({len(prompt)} tokens) is longer "
                              f"than the model's {iface.position_limit} positions")


def calibration_batches(model: onnx.ModelProto, path: str, prompts: list[list[int]]):
    """--calibration's prompts as runs of the model: their tokens in windows of
    calibrated.WINDOW (half the position table where it is shorter), BATCH a run; a
    decoder's prompt runs (empty pasts), any other model's generated inputs (no padding)
    with the windows as its ``input_ids``."""
    from mha_onnx.generate import read_interface

    if not is_decoder(model, path):
        return _encoder_batches(model, prompts)
    iface = read_interface(model, path)
    check_prompts(iface, prompts, "--calibration", run_whole=False)
    length = min([calibrated.WINDOW, *([iface.position_limit // 2] if iface.position_limit
                                       else [])])
    cut = calibrated.windows(prompts, length)
    return [prompt_feeds(iface, cut[i:i + calibrated.BATCH])
            for i in range(0, len(cut), calibrated.BATCH)]


def _encoder_batches(model: onnx.ModelProto, prompts: list[list[int]]):
    from mha_onnx.graph.inputs import case_for, input_specs, make_inputs

    specs = input_specs(model)
    ids = next((s for s in specs if s.name == "input_ids" and s.dtype.kind in "iu"), None)
    if ids is None:
        raise ConfigError("--calibration: the model takes no input_ids",
                          hint="GPTQ calibrates models that read token ids")
    bad = [t for p in prompts for t in p if not 0 <= t < ids.bound]
    if bad:
        raise ConfigError(f"--calibration has token id(s) outside the vocabulary of "
                          f"{ids.bound}: {bad[:5]}")
    cut = calibrated.windows(prompts, calibrated.WINDOW)
    runs = []
    for start in range(0, len(cut), calibrated.BATCH):
        rows = cut[start:start + calibrated.BATCH]
        feeds = make_inputs(specs, case_for(specs, "calibration", len(rows), [len(rows[0])],
                                            "none", lift=False))
        feeds["input_ids"] = np.array(rows, ids.dtype).reshape(feeds["input_ids"].shape)
        runs.append(feeds)
    return runs