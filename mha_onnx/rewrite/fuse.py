"""``fuse()``: every attention block of any ONNX graph onto one fused kernel, verified.

read -> symbolic shapes (shapes.py) -> the target's list of passes (passes.py: prepare,
normalise, recognise, lower, tighten, tidy) -> verification against the original on ORT CPU
-> atomic write. A block that is not fused gets a reason.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import onnx
import onnx_ir as ir

from mha_onnx import __version__
from mha_onnx.errors import BlocksLeft, RuntimeCrash
from mha_onnx.graph import metadata
from mha_onnx.graph.dims import dim_floors, with_related_dims
from mha_onnx.graph.files import prepare_output, read_model, to_ir, write_model
from mha_onnx.graph.inputs import input_specs, load_inputs
from mha_onnx.graph.light import lend, outside_main, structure
from mha_onnx.graph.original import record as record_original
from mha_onnx.graph.preflight import Preflight, preflight
from mha_onnx.rewrite.blocks import why_left
from mha_onnx.rewrite.check.cases import verification_cases
from mha_onnx.rewrite.check.mismatch import refuse_mismatch
from mha_onnx.rewrite.check.verify import verify, verify_on_openvino
from mha_onnx.rewrite.forms import Form
from mha_onnx.rewrite.fuse_report import BlockResult, FuseReport
from mha_onnx.rewrite.irutil import forget_matches, opset
from mha_onnx.rewrite.kv_interface import past_dim
from mha_onnx.rewrite.passes import Prepare, run_pipeline
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.prepare.shapes import with_symbolic_shapes
from mha_onnx.rewrite.recognise.core import (
    BlockLog,
    parse_onnx_attention,
    parse_softmax_attention,
)
from mha_onnx.rewrite.recognise.oracle import Oracle
from mha_onnx.rewrite.recognise.scores import Reject
from mha_onnx.rewrite.tighten.norms import unguarded_norms

log = logging.getLogger(__name__)

def fuse_model(model_proto: onnx.ModelProto, policy: FormPolicy | None = None, *,
               into: Path | None = None) -> tuple[onnx.ModelProto, list[BlockResult], list[str]]:
    """Rewrite a model in memory; returns (fused model, per-block results, notes).
    ``policy``: the target, execution provider and forms (policy.py; default: ONNX Runtime
    on the CPU, its fastest measured forms, the cache appended). ``into``: a folder the
    fused model is written to as it is made (``weights.onnx``, its weights beside it), and
    given back without them (:func:`_set_down`): its weights are never held here."""
    policy = policy or FormPolicy()
    specs = input_specs(model_proto)
    light, weights = structure(model_proto)  # (shapes are read without copying weights)
    model = to_ir(with_symbolic_shapes(with_related_dims(light, specs)))  # one name per axis
    del light
    lend(model, weights)  # (read from model_proto where a pass or the fused model asks)
    facts, notes = run_pipeline(model, policy, floors=dim_floors(specs))
    forget_matches()  # (onnxscript's module-level rules would keep ``model`` alive)
    results = _results(facts.before, facts.blog, facts.chosen)
    fused = ir.to_proto(model) if into is None else _set_down(model, into)
    if facts.packed:  # validate rebuilds PyTorch references from weights: where each went
        metadata.write(fused, {"packed": {k: list(v) for k, v in facts.packed.items()}})
    if facts.cache:  # which outputs are which past's present, by any names
        cache = {**facts.cache, "past_dim": past_dim(model_proto, facts.cache["pairs"])}
        metadata.write(fused, {"kv_cache": cache})
    if fused.ir_version > 10 and model_proto.ir_version <= 10:
        fused.ir_version = model_proto.ir_version
    return fused, results, notes


def understand(model_proto: onnx.ModelProto) -> dict[str, str]:
    """What fuse would make of each unfused attention block, without rewriting anything:
    block name -> its meaning (e.g. "causal + key padding, window 4") or "not fused: why"."""
    specs = input_specs(model_proto)
    related = with_related_dims(model_proto, specs)  # one name per axis
    model = to_ir(with_symbolic_shapes(related))
    Prepare()(model)
    oracle = Oracle(model, floors=dim_floors(specs))
    out: dict[str, str] = {}
    for node in model.graph:
        try:
            if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
                core = parse_softmax_attention(node, opset(model), oracle)
            elif node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
                core = parse_onnx_attention(node, node.name or "Attention", oracle)
            else:
                continue
            out[core.block] = core.describe()
        except Reject as exc:
            if exc.candidate:
                out[exc.block] = f"not fused: {exc.reason}"
    return out


def _fused_result(name: str, blog: BlockLog, form: Form) -> BlockResult:
    core = blog.matched.get(name)
    if core is None:
        return BlockResult(name, "fused", form=form.label, chosen=form)
    details = {"heads": core.heads, "kv_heads": core.kv_heads, "softcap": core.softcap,
               "mask_meaning": core.mask.to_dict()}
    return BlockResult(name, "fused", form=form.label, mask=core.mask.kind,
                       meaning=core.describe(), details=details, chosen=form)


def _results(before, blog: BlockLog, chosen: dict[str, Form]) -> list[BlockResult]:
    """One result per block found before fusing (ONNX Attention nodes are "fused" both
    before and after; rewritten ones are reported as fused into their new form)."""
    results = []
    for block in before:
        name = block.node
        if name in chosen:
            results.append(_fused_result(name, blog, chosen[name]))
        elif block.kind == "fused":
            results.append(BlockResult(name, "already fused", form=block.op))
        else:
            reason = blog.reasons.get(name) or why_left(block.softmax)
            results.append(BlockResult(name, "left", reason=reason))
    return results


def fuse_file(
    source: str | Path,
    output: str | Path,
    *,
    policy: FormPolicy | None = None,
    verify_result: bool = True,
    force: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    inputs: str | Path | None = None,
    strict: bool = False,
    logits: str = "all",
    external: bool = False,
) -> FuseReport:
    """Fuse ``source`` into ``output``; refuses to write when the fused graph's outputs differ
    from the original's beyond tolerance (unless ``verify_result`` is False). ``policy``: the
    target, execution provider and forms (policy.py). ``inputs``: an
    .npz of real inputs to verify with instead of generated ones. ONNX Runtime first meets
    each model in a child process, so a crash in it cannot take this process down. A
    decoder whose folder holds a HF config.json (Optimum's output) records it (GenAI's folder
    beside ``output`` is generate.genai.deliver_genai's, as ``mha-onnx fuse`` writes it).
    ``logits="last"``: the LM head computes each row's last kept position only
    (last_logits.py), checked against the original before fusing. ``external``: the weights
    written beside ``output`` whatever their size (a scratch file that other sessions read
    next: ORT maps such weights in place)."""
    started = time.perf_counter()
    output = prepare_output(output, force=force)
    original = read_model(source)
    given = load_inputs(inputs, input_specs(original)) if inputs is not None else None
    level = _safe_level(preflight(source, prepacking=False), "the original model") \
        if verify_result else "all"
    policy = policy or FormPolicy()
    target = policy.target
    original, notes = _logits(original, logits)
    with tempfile.TemporaryDirectory(prefix="mha_onnx_fuse_") as scratch:
        held = Path(scratch) if target == "ort" else None  # (OpenVINO's check reads bytes)
        fused, results, more = fuse_model(original, policy, into=held)  # (ORT's checks map
        notes += more  # the fused weights from there)
        carry_metadata(original, fused, results, target, policy.ep)
        notes += policy.unmatched({r.mask for r in results if r.status == "fused"})
        unguarded = unguarded_norms(original)
        if unguarded:
            notes.append(_UNGUARDED.format(len(unguarded), unguarded[0]))
        notes += _blocks_left(results, strict)
        verification = _checked(original, fused, results, notes, level, target, given,
                                verify_result, atol, rtol, unguarded, Path(scratch))
        _write(source, original, fused, output, target, force, external, held)
    return FuseReport(
        input=str(source), output=str(output), target=target, blocks=tuple(results),
        verification=verification, seconds=time.perf_counter() - started, written=True,
        notes=tuple(notes),
    )


def _set_down(model: ir.Model, folder: Path) -> onnx.ModelProto:
    """``model`` written in ``folder`` tensor by tensor (``weights.onnx``, its weights
    beside it) and read back without them: what reads them next reads them there. Read in
    whole where a branch holds weights of its own (what writes it later copies the main
    graph's external data only)."""
    path = folder / "weights.onnx"
    ir.save(model, path, external_data="weights.onnx.data", size_threshold_bytes=1024,
            max_workers=1, max_in_flight_bytes=1 << 26)  # (a tensor at a time)
    light = read_model(path, load_external_data=False)
    return read_model(path) if outside_main(light) else light


def _checked(original: onnx.ModelProto, fused: onnx.ModelProto, results, notes: list[str],
             level: str, target: str, given, verify_result: bool, atol: float | None,
             rtol: float | None, unguarded: list[str], scratch: Path):
    """The fused model's preflight (the level it runs at recorded where a higher one
    crashed) and, with ``verify_result``, its outputs against the original's (refused where
    they differ). Each model a file in ``scratch`` (where the fused model's external data
    lies, _set_down) with its weights beside it, which its session reads in place."""
    checked_file = write_model(fused, scratch / "fused.onnx", force=True, external=True)
    checked = preflight(checked_file, prepacking=False)
    fused_level = _safe_level(checked, "the fused model")
    if checked.crashed:
        metadata.write(fused, {"session": {"optimization": fused_level}})
        notes.append(f"{checked.message()}; recorded in the fused model for validate and "
                     "profile")
    if not verify_result:
        return None
    cases = None if given is not None else verification_cases(original, results)
    verification = verify(original, fused, cases=cases, given=given, atol=atol, rtol=rtol,
                          levels=(level, fused_level), scratch=scratch,
                          fused_file=None if checked.crashed else checked_file)
    if target == "openvino":
        verification = verify_on_openvino(original, fused, verification, cases=cases,
                                          given=given, atol=atol, rtol=rtol)
    refuse_mismatch(verification, unguarded)
    return verification


def _write(source, original: onnx.ModelProto, fused: onnx.ModelProto, output: Path,
           target: str, force: bool, external: bool, held: Path | None) -> None:
    """Write the fused model: (ORT target) its original kept inside for `mha-onnx tune` on
    another machine; a decoder's HF config recorded (Optimum's folder: what generate and
    GenAI's folder read; GenAI's folder itself is the delivery's, generate.genai). ``held``:
    the folder where ``fused``'s external data lies."""
    from mha_onnx.graph.decoder import folder_generation

    if target == "ort":
        record_original(original, fused, base=str(held or ""))
    folder_generation(source, fused)
    write_model(fused, output, force=force, external=external, base=held)


def _blocks_left(results: list[BlockResult], strict: bool) -> list[str]:
    """``--strict`` refuses a model with blocks left unfused; a model without attention
    is said to be copied unchanged."""
    left = [r for r in results if r.status == "left"]
    if strict and left:
        raise BlocksLeft(f"{len(left)} of {len(results)} attention block(s) left unfused "
                         f"(first: {left[0].block}: {left[0].reason}); nothing was written",
                         hint="without --strict the model is written with those blocks as "
                              "they are; `mha-onnx inspect` shows why each is left")
    return [] if results else ["the model has no attention block; the output is an "
                               "unchanged copy"]


def _logits(original: onnx.ModelProto, logits: str) -> tuple[onnx.ModelProto, list[str]]:
    """``logits="last"``: the original with the LM head of each row's last position only
    (what fuse verifies against from here on), checked against it; and the note."""
    if logits != "last":
        return original, []
    from mha_onnx.rewrite.last_logits import with_last_logits

    return with_last_logits(original), ["logits of each row's last kept position only "
                                        "([batch, 1, vocab]), checked against the original's"]


def _safe_level(checked: Preflight, what: str) -> str:
    """The optimisation level at which ORT runs a model without crashing; a model it crashes
    on at every level is refused (exit 3). A model ORT merely refuses is left to verify, which
    falls back to the ONNX reference evaluator for the original."""
    if checked.crashed and checked.level is None:
        raise RuntimeCrash(f"{what}: {checked.message()}",
                           hint="nothing was written; please report this model to onnxruntime")
    return checked.level or "all"


_UNGUARDED = ("{} RMS normalisation(s) of the original have no epsilon (first: {}): a row "
              "of zeros (a padding token's embedding) gives NaN there; torch.onnx.export's "
              "optimizer drops an epsilon <= 1e-8 as zero: export with optimize=False or "
              "`mha-onnx export --model`")


def carry_metadata(original: onnx.ModelProto, fused: onnx.ModelProto,
                    results: list[BlockResult], target: str, ep: str = "cpu") -> None:
    """Keep the original's metadata (mha-onnx's config among it) and record the fusion (and
    the KV-cache interface and packed weights fuse_model recorded)."""
    kept = {key: metadata.loaded(fused, key) for key in ("kv_cache", "packed")}
    del fused.metadata_props[:]
    fused.metadata_props.extend(original.metadata_props)
    metadata.write(fused, {key: value for key, value in kept.items() if value is not None})
    summary = {"version": __version__, "target": target, "ep": ep,
               "blocks": [r.to_dict() for r in results]}
    metadata.write(fused, {"fusion": summary})
