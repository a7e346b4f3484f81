"""A 4- or 8-bit decoder's prompt in float compute, where the CPU's int8 compute is slower.

ONNX Runtime's MatMulNBits at accuracy level 4 (int8 activations: GenAI's CPU default and
``quantize``'s) makes a decode step fast; on most CPUs measured a long prompt slow, level 1
(float compute) the other way round. On the bench's 2-layer Llama in int4 (AMD EPYC without
VNNI, 2 threads; docs/history/bench-notebook.md): a 1024-token prompt at level 4 1.28x the float model's
time, at level 1 1.00x; a decode step at level 4 0.45x, at level 1 1.24x; level 1 behind
at 16 tokens and ahead from 64 (Intel Xeon with AMX: 1.27x and 1.06x). So there
(``fast_int8`` false) the generator runs a prompt of ``PROMPT_ROWS`` tokens or more through
a second session of the same file with every MatMulNBits at level 1 (a shared-cache
fusion: every prompt, and its steps through its decode graph, decode.py). On an AMD CPU
with AVX-512 VNNI (a 1024-token prompt 0.81x of float at level 4) every run goes through
the file as written. The two sessions share the cache buffers (bound to both) and every
large float initializer (one OrtValue given to both: the embeddings are not held twice);
each packs its own copy of the quantized weights, in its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from mha_onnx.graph.walk import all_nodes, attr

PROMPT_ROWS = 64  # prompts this long and longer run in float compute
FLOAT_LEVEL = 1
SHARED_BYTES = 1 << 20  # float initializers this large are given to both sessions once
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


@dataclass
class FloatPrompt:
    """The model with its MatMulNBits at ``FLOAT_LEVEL`` (serialized, its external data
    still in ``folder``), and the initializers both sessions share (name -> OrtValue;
    ``arrays`` keeps their memory alive)."""

    model: bytes
    folder: Path
    initializers: dict[str, Any]
    arrays: list[np.ndarray]
    levels: tuple[int, ...]  # the file's accuracy levels


def _array(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    if uses_external_data(tensor):  # (read into a copy: the model keeps its reference)
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        load_external_data_for_tensor(copy, str(folder))
        tensor = copy
    return np.ascontiguousarray(numpy_helper.to_array(tensor))


def _quantized(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in all_nodes(model.graph)
            if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"]


def fast_int8(cpuinfo: str | None = None) -> bool:
    """Whether MatMulNBits at level 4 (int8 compute) reads a long prompt faster than float
    compute on this CPU. Measured (docs/history/bench-notebook.md; the bench Llama's 1024-token int4 prompt
    against its float32 fusion's, 2 threads): AMD EPYC with AVX-512 VNNI 0.79-0.81x at level
    4 (yes); AMD EPYC without VNNI 1.24-1.29x, level 1 1.00x; Intel Xeon with AMX and
    AVX-512 VNNI 1.24-1.35x, level 1 1.06x (its float GEMM is the faster one: level 4
    slower at every length from 64 tokens). So an AMD CPU with AVX-512 VNNI; any other,
    measured or not, gets the float prompt, the nearer to float32 wherever measured.
    ``cpuinfo``: the text to read, /proc/cpuinfo's by default."""
    from mha_onnx.runtime.machine import cpu_isa, cpu_vendor, cpuinfo_text

    text = cpuinfo_text() if cpuinfo is None else cpuinfo  # (read once for both)
    return cpu_vendor(text) == "AuthenticAMD" and cpu_isa(text) == "AVX-512 VNNI"


def floats_prompts(model: onnx.ModelProto, wanted: bool | None) -> bool:
    """Whether a CPU generator runs ``model``'s prompts in float compute: its MatMulNBits
    compute in int8 (accuracy level 2 or more) and ``wanted`` says so, or (None) the CPU has
    no fast int8 (:func:`fast_int8`)."""
    floated = wanted if wanted is not None else not fast_int8()
    return floated and any(attr(n, "accuracy_level", 0) >= 2 for n in _quantized(model))


def float_prompt(path: str | Path, read: onnx.ModelProto | None = None) -> FloatPrompt | None:
    """For a file whose MatMulNBits compute in int8 (accuracy level 2 or more), its float
    prompt session's model and shared initializers; None for any other file. The model is
    read without its external data (ONNX Runtime reads that from the file's folder);
    ``read``: the file as the caller already read it so (copied here, not changed)."""
    import onnxruntime as ort

    from mha_onnx.graph.files import read_model

    model = read if read is not None else read_model(path, load_external_data=False)
    levels = tuple(sorted({attr(n, "accuracy_level", 0) for n in _quantized(model)}))
    if not levels or levels[-1] < 2:
        return None
    if read is not None:
        model = onnx.ModelProto()
        model.CopyFrom(read)
    nodes = _quantized(model)
    packed = {n.input[1] for n in nodes}
    for node in nodes:
        for attribute in node.attribute:
            if attribute.name == "accuracy_level":
                attribute.i = FLOAT_LEVEL
    folder = Path(path).resolve().parent
    arrays, shared = [], {}
    for tensor in model.graph.initializer:
        size = np.prod(tensor.dims, dtype=np.int64) * (4 if tensor.data_type == _FLOATS[0] else 2)
        if tensor.data_type in _FLOATS and tensor.name not in packed and size >= SHARED_BYTES:
            arrays.append(_array(tensor, folder))
            shared[tensor.name] = ort.OrtValue.ortvalue_from_numpy(arrays[-1])
    return FloatPrompt(model.SerializeToString(), folder, shared, arrays, levels)


def sessions(model: str | Path, proto: Any, shared: bool, second: bool,
             wanted: bool | None) -> tuple[Any, Any]:
    """(the float prompt's session's model, prompt.py, or None; the decode graph, decode.py,
    or None). Where the prompt runs in float compute (a CPU without fast int8, or asked
    for) a shared-cache fusion's prompts all run there and its steps through its decode
    graph (two sessions either way); another file's long prompts only. With fast int8 the
    file as written, one session: a second one for the decode graph alone read a 2-layer
    step no faster and its first token 1.45x slower (pool threads; docs/history/bench-notebook.md)."""
    from mha_onnx.generate.decode import decode_graph

    if not second or not floats_prompts(proto, wanted):
        return None, None
    made = float_prompt(model, proto)
    return made, decode_graph(proto) if made is not None and shared else None
