"""Whether a file's steps and chunks run mixed (mixed.py): the mixed graph's session, made
only where it takes the inputs the rows give it and where a probe on scratch buffers gives
the logits of the two runs apart."""

from __future__ import annotations

from typing import Any

import numpy as np

from mha_onnx.graph.decoder import LOGITS
from mha_onnx.serve.mixed import (
    CHUNK_LENGTHS,
    CHUNK_TOTAL,
    LAST,
    STEP_LENGTHS,
    STEP_TOTAL,
    chunk_name,
    mixed_graph,
)


def mixed_runner(generator: Any, made: Any = None) -> Any | None:
    """An ONNX Runtime runner of the mixed graph of ``generator``'s file (``made``, else made
    here; on the CPU, its threads and optimization level), or None where the graph cannot be
    made, takes other inputs than these, or a chunk runs through another session than a step
    (a quantized file's prompts in float compute, generate/prompt.py: a chunk there gives
    other numbers)."""
    from mha_onnx.graph.decoder import IDS, POSITIONS
    from mha_onnx.graph.files import read_model
    from mha_onnx.runtime.ort import OrtRunner

    if generator.float_prompt is not None or generator.runner.provider != "cpu":
        return None
    if made is None:
        made = mixed_graph(read_model(generator.path, load_external_data=False))
    if made is None:
        return None
    pasts = [past for past, _ in generator.interface.pasts]
    known = {IDS, POSITIONS, STEP_LENGTHS, STEP_TOTAL, CHUNK_LENGTHS, CHUNK_TOTAL, LAST,
             *pasts, *(chunk_name(p) for p in pasts)}
    presents = [present for _, present in generator.interface.pasts]
    if any(v.name not in known for v in made.graph.input) or any(
            v.name not in {LOGITS, *presents, *(chunk_name(p) for p in presents)}
            for v in made.graph.output):
        return None
    runner = OrtRunner(made.SerializeToString(), "cpu", threads=generator._threads,
                       optimization=generator._level, stop_spinning=True,
                       external_data_dir=generator.path.parent)
    runner.session  # noqa: B018 (made now, then the bytes let go)
    runner.model = b""
    try:
        if _agrees(generator, runner):
            return runner
    except Exception:  # noqa: BLE001 - (a graph ORT cannot run: no mixing, said by None)
        pass
    runner.close()
    return None


def _agrees(generator: Any, runner: Any) -> bool:
    """The probe: two rows joined, then a step with a prompt's two chunks, mixed and one
    after the other on scratch buffers: the same logits (float rounding apart)."""
    from mha_onnx.serve.rows import SharedRows

    vocab = generator.interface.vocab
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in (5, 3, 6)]
    got = []
    for mixer in (None, runner):
        rows = SharedRows(generator, 3, 16)
        for row in (0, 1):
            rows.join(row, prompts[row])
        rows.mixer, out = mixer, []
        for upto in (4, 6):
            tokens = np.array([(11 * upto + r) % vocab for r in range(2)], np.int64)
            if mixer is None:  # (the step first: the row joins after it)
                out += [rows.step(tokens), rows.prefill(2, prompts[2], upto)]
            else:
                out += list(rows.mixed(tokens, 2, prompts[2], upto))
        got.append(out)
    scale = max(float(np.abs(a).max()) for a in got[0] if a is not None)
    return all((a is None and b is None) or (a is not None and b is not None and np.allclose(
        a, b, rtol=1e-3, atol=1e-3 * scale)) for a, b in zip(*got, strict=True))
