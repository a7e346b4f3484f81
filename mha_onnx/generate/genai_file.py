"""The file ONNX Runtime GenAI runs beside a shared-cache fusion: its decode graph.

A ``fuse --kv-cache shared`` decoder picks each layer's form at run time (decode.py): an
``If`` per layer, whose cost every step pays (int4 Llamas of 2 and 16 layers, 20 steps at
context 1024: the file as written 1.10x and 1.08x of GenAI's own graph of the same
weights, its Ifs inlined 1.025x and 1.003x; docs/history/bench-notebook.md, the quantize section). GenAI
feeds one contract only: a prompt without past (a batch right-padded), then one token per
row and step. Where the then branches give
what the file gives on that contract, GenAI gets the file without the Ifs
(``<name>.genai.onnx``, named by genai_config.json) and ``generate``, ``validate`` and
every other input form keep the file as written.

"Give what the file gives" is checked, not assumed: the guard sends GenAI's prompt (no
past, keys padded) to the general form, so the inlined graph runs it on another kernel.
Both run a probe of GenAI's contract (two rows of unequal length, right-padded, then one
step each on its own cache) and must agree, at the output dtype's tolerance (stats.py), on
the logits of every kept token, the caches' kept positions and the step's logits. A
sliding window does not, once a right-padded row's step has the window behind it (the
file counts the padding inside the window, GroupQueryAttention does not), so the probe's
full row runs past the widest window; layers on different guards (a window's layers test
it too) have no one then branch. GenAI then runs the file as written, and the note says
why (docs/families.md: which families get which).

The two files share one copy of the weights: the file as written keeps them in
``<name>.data`` (moved there where it embedded them), which the GenAI file's tensors name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from mha_onnx.generate.decode import guards, inline_ifs, shared_guard, without_unread
from mha_onnx.graph.decoder import IDS, LOGITS, MASK, POSITIONS, DecoderInterface

SUFFIX = ".genai.onnx"
GENAI_RECORD = "genai_file"  # metadata of the file written: {"of": the file as written}
PROBE_ROWS = (24, 9)  # a full row and a right-padded one (the full one past any window)


@dataclass(frozen=True)
class GenAiFile:
    """The file genai_config.json names, and what to say of it."""

    filename: str
    note: str = ""


def genai_target(model: Path) -> Path:
    return model.with_name((model.name[:-5] if model.name.endswith(".onnx") else model.name)
                           + SUFFIX)


def genai_file(model: Path, proto: onnx.ModelProto, iface: DecoderInterface) -> GenAiFile:
    """Write GenAI's file beside ``model`` (the module doc) where it gives what the file as
    written gives; otherwise name the file as written (a stale GenAI file removed)."""
    target = genai_target(model)
    if not iface.shared or shared_guard(proto) is None:
        target.unlink(missing_ok=True)
        tested = guards(proto)
        return GenAiFile(model.name, "" if not iface.shared or not tested else
                         f"GenAI runs {model.name} as written: its layers choose their forms "
                         f"by {len(tested)} different guards (a sliding window's layers "
                         f"check their window too), so no one form serves every run")
    from mha_onnx.errors import MhaOnnxError

    try:
        differs = probe_differs(model, proto, iface)
    except MhaOnnxError as exc:  # (ORT refused the inlined file, or the probe's run)
        differs = f"ORT could not run the probe: {str(exc)[:200]}"
    if differs:
        target.unlink(missing_ok=True)
        return GenAiFile(model.name, f"GenAI runs {model.name} as written (each layer's form "
                                     f"chosen per run): its Ifs inlined differ on GenAI's "
                                     f"right-padded prompt: {differs}")
    data = _weights_outside(model, proto)
    from mha_onnx.graph import metadata
    from mha_onnx.graph.files import read_model, write_bytes

    made = decode_file(read_model(model, load_external_data=False))
    metadata.write(made, {GENAI_RECORD: {"of": model.name}})
    write_bytes(made.SerializeToString(), target, force=True)
    return GenAiFile(target.name, f"GenAI runs {target.name}: {model.name} without its "
                                  f"per-layer Ifs (the form each of GenAI's runs takes, "
                                  f"checked on a right-padded batch), its weights read from "
                                  f"{data}")


def decode_file(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every If replaced by its then branch and what nothing reads removed
    (no guard output: GenAI reads only the outputs its config names)."""
    return without_unread(inline_ifs(proto))


def _weights_outside(model: Path, proto: onnx.ModelProto) -> str:
    """The external-data file(s) of ``model``, its tensors moved to ``<name>.data`` first
    where it embeds them."""
    from mha_onnx.graph.files import external_files, read_model, write_model

    found = external_files(proto, model)
    if not found:
        write_model(read_model(model), model, force=True, external=True)
        found = external_files(read_model(model, load_external_data=False), model)
    return ", ".join(f.name for f in found) or "itself (no tensor of 1 KiB or more)"


def probe_feeds(iface: DecoderInterface, rows: tuple[int, ...] = PROBE_ROWS
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """GenAI's prompt run over ``rows`` tokens per row (right-padded with its pad token, no
    past in zeroed buffers one step longer than the longest row) and the step after it
    without its caches (each graph steps on its own)."""
    rng = np.random.default_rng(0)
    batch, longest = len(rows), max(rows)
    pad = iface.tokens.pad if iface.tokens.pad is not None else iface.tokens.eos[0]
    ids = np.full((batch, longest), pad, np.int64)
    mask = np.zeros((batch, longest), np.int64)
    for b, n in enumerate(rows):
        ids[b, :n] = rng.integers(0, iface.vocab, n)
        mask[b, :n] = 1
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)
    prompt = {IDS: ids, MASK: mask, POSITIONS: positions}
    step = {IDS: rng.integers(0, iface.vocab, (batch, 1)),
            MASK: np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1),
            POSITIONS: np.array([[n] for n in rows], np.int64)}
    cast = {k: iface.dtypes[k] for k in (IDS, MASK, POSITIONS) if k in iface.dtypes}
    prompt = {k: prompt[k].astype(t) for k, t in cast.items()}
    step = {k: step[k].astype(t) for k, t in cast.items()}
    for past, _ in iface.pasts:
        shape = (batch, iface.kv_heads_of(past), longest + 1, iface.head_of(past))
        prompt[past] = np.zeros(shape, iface.kv_dtype)
    return prompt, step


def _runs(runner, iface: DecoderInterface, prompt: dict, step: dict) -> dict[str, np.ndarray]:
    """The prompt's and the step's outputs (the step's prefixed ``step:``)."""
    first = runner.infer(prompt)
    feeds = dict(step) | {past: first[present] for past, present in iface.pasts}
    return first | {f"step:{k}": v for k, v in runner.infer(feeds).items() if k == LOGITS}


def probe_differs(model: Path, proto: onnx.ModelProto, iface: DecoderInterface,
                  rows: tuple[int, ...] = PROBE_ROWS) -> str:
    """Where the decode file and the file as written differ on GenAI's contract (module
    doc), in one line; "" where they agree."""
    from mha_onnx.graph.metadata import session_options
    from mha_onnx.runtime.ort import OrtRunner
    from mha_onnx.stats import compare

    limit = (iface.position_limit or iface.context_length or 1 << 20) - 2  # (and a step)
    window = _window(proto)  # (the full row past it: the padded row's step sees no prompt
    if window > 0:           # in the file's window, which counts the padding, GQA's does)
        rows = (max(rows[0], window + 8), *rows[1:])
    rows = tuple(max(1, min(n, limit)) for n in rows)
    prompt, step = probe_feeds(iface, rows)
    level = session_options(proto).get("optimization", "all")
    want = _runs(OrtRunner(str(model), optimization=level), iface, prompt, step)
    inlined = OrtRunner(decode_file(proto).SerializeToString(), optimization=level,
                        external_data_dir=model.parent)
    got = _runs(inlined, iface, prompt, step)
    presents = {present for _, present in iface.pasts}
    int8 = _int8_cache(proto)
    for name, expected in want.items():
        pairs = zip(_kept(name, got[name], rows, presents), _kept(name, expected, rows, presents),
                    strict=True)
        for b, (actual, kept) in enumerate(pairs):
            stats = compare(actual.astype(np.float32), kept.astype(np.float32)) if int8 \
                else compare(actual, kept)
            if int8 and stats.cosine >= INT8_COSINE:
                continue
            if not stats.passed:
                return f"{name}, row {b}: max abs error {stats.max_abs:.3g} (atol {stats.atol:g})"
    return ""


INT8_COSINE = 0.995  # an int8 cache: outputs agree this closely where the forms round apart


def _int8_cache(proto: onnx.ModelProto) -> bool:
    """A file whose cache ``quantize --kv-bits 8`` made int8. The file as written attends a
    prompt over its float keys and values and writes them rounded; the file GenAI runs
    (GroupQueryAttention on the int8 buffer) attends over the int8 cache and lands some
    values a step off. The first layer's cache agrees within a step, later layers' and the
    logits only as closely as two roundings do (on the bench's random Llama in float16:
    cosine 0.9989 and up; a form that mishandles a padded row is far off): every output
    is compared by its cosine."""
    from mha_onnx.graph.cache import has_int8_cache

    return has_int8_cache(proto)


def _window(proto: onnx.ModelProto) -> int:
    """The widest sliding window of the file's GroupQueryAttention nodes (0: none)."""
    from mha_onnx.graph.walk import all_nodes

    return max((a.i for n in all_nodes(proto.graph) if n.op_type == "GroupQueryAttention"
                for a in n.attribute if a.name == "local_window_size"), default=0)


def _kept(name: str, value: np.ndarray, rows: tuple[int, ...], presents: set[str]
          ) -> list[np.ndarray]:
    """Per row, what GenAI reads of output ``name``: the logits of its tokens (of the last
    position only: of the rows without padding), its cache's positions, the step's logits."""
    if name in presents:
        return [value[b, :, :n] for b, n in enumerate(rows)]
    if name != LOGITS:
        return list(value)
    if value.shape[1] == max(rows):
        return [value[b, :n] for b, n in enumerate(rows)]
    return [value[b] for b, n in enumerate(rows) if n == max(rows)]
