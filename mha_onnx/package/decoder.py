"""``package`` of a decoder with a KV cache: a stateful Triton model whose cache stays on the
server (sequence batching with implicit state), and a client loop that runs.

Each past input is a Triton *state* (not a request input): Triton feeds the present a
request returned as the next request's past, per sequence (``sequence_id``). A request
carries the new tokens only (``input_ids``, ``position_ids``) and the whole
``attention_mask`` (one small integer per position); the reply is the logits.

The first request of a sequence gets Triton's initial state, zeros:

- an appended cache: one position (Triton's initial state cannot be empty), which the
  client's mask hides with a leading 0 column, so the mask is [0, 1, 1, ...] over that
  position, the prompt and every token after it; ONNX Runtime's backend copies each step's
  present into the state;
- a shared cache (``fuse --kv-cache shared``): the whole buffer of ``max_length``
  positions, the mask without that column. The backend copies the whole buffer into the
  state after every request (it does not bind one buffer as past and present), so the
  appended form is the cheaper one to serve this way.

One sequence per batch slot (``max_batch_size`` 1, the Direct strategy): requests of
different lengths do not batch; ``--instances N`` serves N sequences at once.

What Triton can batch for a decoder, and what it cannot (said in the repository's README):
its sequence batcher puts one sequence in each batch slot and runs the slots that have a
request together, but the ONNX model takes one past length for the whole batch, so steps of
sequences at different lengths never share a run, and no sequence joins a running batch
between its steps. Many users at once on one decoder is ``mha-onnx serve``'s job
(continuous batching: every running sequence in each decode step, mha_onnx.serve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mha_onnx.errors import ConfigError
from mha_onnx.graph.decoder import IDS, LOGITS, MASK, POSITIONS, DecoderInterface
from mha_onnx.package.pbtxt import TRITON_TYPES

IDLE_MICROSECONDS = 60_000_000  # a sequence without a request for a minute is dropped


@dataclass(frozen=True)
class DecoderServing:
    """How a decoder is served statefully: its interface and the cache's first length."""

    iface: DecoderInterface
    initial_length: int  # 1 (appended: one hidden position) or the shared buffer's length

    @property
    def hidden_position(self) -> bool:
        return not self.iface.shared


def decoder_serving(model, max_length: int) -> DecoderServing | None:
    """The serving plan of a token decoder with a KV cache (None for any other model)."""
    from mha_onnx.graph.cache import cache_pairs
    from mha_onnx.graph.decoder import read_interface

    names = {i.name for i in model.graph.input}
    if IDS not in names or not cache_pairs(model) \
            or not any(o.name == LOGITS for o in model.graph.output):
        return None
    iface = read_interface(model)
    if iface.shared and iface.length_input:
        raise ConfigError("package: this shared-cache model takes past_sequence_length as an "
                          "input, which a stateful Triton model cannot derive per request",
                          hint="package the appended model (fuse without --kv-cache shared)")
    if not iface.has_mask and not iface.shared:
        raise ConfigError("package: the decoder has no attention_mask, which must hide the "
                          "empty position its cache starts from on Triton",
                          hint="export it with an attention_mask input")
    return DecoderServing(iface, max_length if iface.shared else 1)


def stateful_config(serving: DecoderServing, cfg, target: str, threads: int) -> dict[str, Any]:
    """The model config: request inputs and outputs without the cache, one implicit state
    per past, zero initial state."""
    if target not in ("cpu", "cuda"):
        raise ConfigError(f"package: a decoder with a KV cache is served statefully on the "
                          f"onnxruntime backend only, not {target}",
                          hint="--target cpu or --target cuda")
    iface = serving.iface
    kv = TRITON_TYPES[iface.kv_dtype]
    requests = [{"name": name, "data_type": TRITON_TYPES[iface.dtypes[name]], "dims": [-1]}
                for name in (IDS, MASK, POSITIONS) if name in iface.dtypes]
    states = []
    for past, present in iface.pasts:
        heads, head = iface.kv_heads_of(past), iface.head_of(past)
        states.append({"input_name": past, "output_name": present, "data_type": kv,
                       "dims": [heads, -1, head], "initial_state": {
                           "data_type": kv, "dims": [heads, serving.initial_length, head],
                           "zero_data": True, "name": f"empty {past}"}})
    logits = _logits_type(iface)
    config: dict[str, Any] = {
        "name": cfg.name, "backend": "onnxruntime", "max_batch_size": 1,
        "input": requests,
        "output": [{"name": LOGITS, "data_type": logits,
                    "dims": [1 if iface.last_logits else -1, iface.vocab]}],
        "sequence_batching": {"max_sequence_idle_microseconds": IDLE_MICROSECONDS,
                              "direct": {}, "state": states},
        "instance_group": [{"count": cfg.instances,
                            "kind": "KIND_GPU" if target == "cuda" else "KIND_CPU"}],
        "parameters": {"intra_op_thread_count": {"string_value": str(threads)},
                       "inter_op_thread_count": {"string_value": "1"}},
    }
    return config


def _logits_type(iface: DecoderInterface) -> str:
    return TRITON_TYPES["float16" if iface.kv_dtype == "float16" else "float32"]


def decoder_notes(serving: DecoderServing) -> list[str]:
    notes = ["a decoder with a KV cache: served statefully (sequence batching, one implicit "
             "state per past: the cache stays on the server); a request sends the new tokens "
             "and the whole attention_mask; see README.md"]
    if serving.iface.shared:
        notes.append(f"shared cache: each sequence holds {serving.initial_length} positions "
                     "(the longest of --lengths), and Triton's onnxruntime backend copies the whole "
                     "buffer into the state after every request: the appended model is "
                     "cheaper to serve this way")
    return notes


def decoder_request(serving: DecoderServing, name: str, prompt: list[int], steps: int
                    ) -> list[str]:
    """A client loop (Python, tritonclient) that generates ``steps`` greedy tokens: what the
    README shows and the tests run against the repository."""
    iface = serving.iface
    types = {n: (t, TRITON_TYPES[t].removeprefix("TYPE_")) for n, t in iface.dtypes.items()}
    hidden = "[0] + " if serving.hidden_position else ""
    inputs = [f'"{IDS}": new'] + ([f'"{MASK}": mask'] if iface.has_mask else []) + (
        [f'"{POSITIONS}": list(range(position, position + len(new)))']
        if iface.has_positions else [])
    return [
        "import numpy as np, tritonclient.http as http",
        'client = http.InferenceServerClient("localhost:8000")',
        f"TYPES = {types!r}  # numpy and Triton types of the request inputs",
        "",
        "",
        "def request(inputs, first, last):",
        '    """One step of sequence 1: the server keeps its cache (implicit state)."""',
        "    tensors = []",
        "    for name, values in inputs.items():",
        "        array = np.array([values], dtype=TYPES[name][0])  # batch 1",
        "        tensors.append(http.InferInput(name, list(array.shape), TYPES[name][1]))",
        "        tensors[-1].set_data_from_numpy(array)",
        f'    result = client.infer("{name}", tensors, sequence_id=1, sequence_start=first,',
        "                          sequence_end=last)",
        f'    return result.as_numpy("{LOGITS}")[0, -1]  # the last position\'s logits',
        "",
        "",
        f"prompt = {prompt}",
        f"mask = {hidden}[1] * len(prompt)"
        + ("  # 0: the empty position the cache starts from" if hidden else ""),
        "tokens, new, position = [], prompt, 0",
        f"for step in range({steps}):",
        f"    inputs = {{{', '.join(inputs)}}}",
        f"    token = int(request(inputs, step == 0, step == {steps - 1}).argmax())",
        "    tokens.append(token)",
        "    position, new, mask = position + len(new), [token], mask + [1]",
        "print(tokens)",
    ]
