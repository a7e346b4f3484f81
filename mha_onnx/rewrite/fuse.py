"""``fuse()``: every attention block of any ONNX graph onto one fused kernel, verified.

Pipeline: read -> (opset upgrade for ``--target onnx``) -> shape inference -> stage 1 (attention
cores -> internal Sdpa) -> stage 2 (Sdpa -> the target's kernel) -> cleanup -> verification
against the original on ORT CPU -> atomic write. A block that is not fused gets a reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import remove_unused_nodes
from onnxscript.rewriter import RewriteRuleSet

from mha_onnx import __version__, metadata
from mha_onnx.cache import LENGTH_INPUT
from mha_onnx.errors import BlocksLeft, ConfigError, RuntimeCrash
from mha_onnx.graphdims import dim_floors, with_related_dims
from mha_onnx.graphio import prepare_output, read_model, to_ir, write_model
from mha_onnx.inputs import input_specs, load_inputs
from mha_onnx.original import record as record_original
from mha_onnx.preflight import Preflight, preflight
from mha_onnx.rewrite.blocks import all_graphs, find_blocks, why_left
from mha_onnx.rewrite.core import (
    BlockLog,
    OnnxAttention,
    SoftmaxAttention,
    parse_onnx_attention,
    parse_softmax_attention,
)
from mha_onnx.rewrite.faithful import optimize_faithfully
from mha_onnx.rewrite.forms import Form
from mha_onnx.rewrite.fuse_report import BlockResult, FuseReport
from mha_onnx.rewrite.irutil import MS_DOMAIN, opset
from mha_onnx.rewrite.kv_interface import past_dim, shared_note
from mha_onnx.rewrite.layer import tighten_layers
from mha_onnx.rewrite.lower.attention import ONNX_ATTENTION_OPSET, LowerToOnnxAttention
from mha_onnx.rewrite.lower.ort import Forms
from mha_onnx.rewrite.lower.rules import lower_to_ort
from mha_onnx.rewrite.lower.shared import length_from_shapes, share_interface, shared_rows
from mha_onnx.rewrite.norms import omit_unread_outputs, unguarded_norms
from mha_onnx.rewrite.oracle import Oracle
from mha_onnx.rewrite.repairs import RotaryCachesOverBatch
from mha_onnx.rewrite.scores import Reject
from mha_onnx.rewrite.sdpa import FUSION_DOMAIN
from mha_onnx.rewrite.shapes import fold_static_dims, probability_shapes, with_symbolic_shapes
from mha_onnx.rewrite.shared_probs import distribute_combinations, merge_value_matmuls
from mha_onnx.rewrite.verify import (
    refuse_mismatch,
    verification_cases,
    verify,
    verify_on_openvino,
)
from mha_onnx.rewrite.windows import window_mask_rules

log = logging.getLogger(__name__)

# openvino: the standard ops of ``onnx`` (OpenVINO fuses them into its own attention; measured
# as fast as any contrib form there, docs/bench.md), verified on OpenVINO itself as well.
TARGETS = ("ort", "onnx", "openvino")


def _prepare(model: ir.Model, target: str) -> list[str]:
    notes = []
    if model.functions:
        common_passes.InlinePass()(model)
    _unique_node_names(model)
    if target == "onnx" and opset(model) < ONNX_ATTENTION_OPSET:
        from onnxscript.version_converter import convert_version

        before = opset(model)
        convert_version(model, ONNX_ATTENTION_OPSET, fallback=True)
        model.opset_imports[""] = ONNX_ATTENTION_OPSET
        notes.append(f"opset upgraded {before} -> {ONNX_ATTENTION_OPSET} for the ONNX Attention op")
    try:
        common_passes.ShapeInferencePass()(model)
    except Exception as exc:  # noqa: BLE001 - shapes only help; rules fail without them
        log.warning("shape inference failed (%s); fusing with the shapes in the file", exc)
    fold_static_dims(model)  # static dims read by Shape chains: constants to fold further
    probability_shapes(model)  # dims of a Softmax's output read elsewhere: DeBERTa's views
    try:  # constant folding: masks that are constant (e.g. all-keep) become visible as such
        optimize_faithfully(model)
    except Exception as exc:  # noqa: BLE001 - optional clean-up
        log.warning("onnxscript optimizer failed (%s); fusing the graph as it is", exc)
    return notes


def _unique_node_names(model: ir.Model) -> None:
    """One identity per block: node names unique over the model, subgraphs included (an
    Optimum merged decoder's two If branches name their nodes alike); a repeated name gets
    its graph's name (the branch) after it."""
    seen: set[str] = set()
    for graph in all_graphs(model.graph):
        for node in graph:
            name = node.name or node.op_type
            if name in seen:
                base, n = f"{name}@{graph.name or 'subgraph'}", 1
                name = base
                while name in seen:
                    n += 1
                    name = f"{base}#{n}"
            node.name = name
            seen.add(name)


def fuse_model(
    model_proto: onnx.ModelProto, *, target: str = "ort", forms: Forms | None = None,
    kv_cache: str | None = None,
) -> tuple[onnx.ModelProto, list[BlockResult], list[str]]:
    """Rewrite a model in memory; returns (fused model, per-block results, notes).
    ``forms`` overrides the kernel form per mask kind (ORT target; for measurements);
    ``kv_cache="shared"`` turns the KV cache into max-length buffers (lower/shared.py)."""
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}", hint=f"use {' | '.join(TARGETS)}")
    ungroup = target == "openvino"  # OpenVINO's Attention import takes no grouped K/V
    target = "onnx" if target == "openvino" else target  # the same standard-op lowering
    policy = forms or Forms()
    if kv_cache is not None:
        policy = replace(policy, kv_cache=kv_cache)
    if policy.kv_cache == "shared" and target != "ort":
        raise ConfigError("--kv-cache shared is an ONNX Runtime form", hint="use --target ort")
    specs = input_specs(model_proto)
    related = with_related_dims(model_proto, specs)  # one name per axis
    model = to_ir(with_symbolic_shapes(related))
    notes = _prepare(model, target)
    notes += _normalise(model)
    before = find_blocks(model.graph)
    blog = BlockLog()
    chosen: dict[str, Form] = {}
    packed: dict[str, tuple[str, int, int]] = {}
    oracle = Oracle(model, floors=dim_floors(specs))
    RewriteRuleSet([SoftmaxAttention.rule(blog, opset(model), oracle, target, policy)]
                   ).apply_to_model(model)
    RewriteRuleSet([OnnxAttention.rule(blog, oracle, target, policy)]).apply_to_model(model)
    remove_unused_nodes(model)
    cache: dict | None = None
    if target == "ort":
        cache, packed = _lower_ort(model, policy, chosen, notes)
    else:
        RewriteRuleSet([LowerToOnnxAttention.rule(chosen, ungroup)]).apply_to_model(model)
    model.opset_imports.pop(FUSION_DOMAIN, None)
    remove_unused_nodes(model)
    common_passes.NameFixPass()(model)
    omit_unread_outputs(model.graph)
    results = _results(before, blog, chosen)
    fused = ir.to_proto(model)
    if packed:  # validate rebuilds PyTorch references from weights: where each one went
        metadata.write(fused, {"packed": {k: list(v) for k, v in packed.items()}})
    if cache:  # which outputs are which past's present, by any names
        cache["past_dim"] = past_dim(model_proto, cache["pairs"])
        metadata.write(fused, {"kv_cache": cache})
    if fused.ir_version > 10 and model_proto.ir_version <= 10:
        fused.ir_version = model_proto.ir_version
    return fused, results, notes


def _lower_ort(model: ir.Model, policy: Forms, chosen: dict[str, Form], notes: list[str]
               ) -> tuple[dict | None, dict[str, tuple[str, int, int]]]:
    """Stage 2 onto ORT's kernels, the KV-cache interface (shared buffers where asked) and
    the layers tightened; (the cache record or None, where packed weights went)."""
    stage = lower_to_ort(model, policy)
    chosen.update(stage.forms)
    pairs = stage.pairs(model.graph)
    rows = shared_rows(stage.layers)
    shared = share_interface(model.graph, stage.layers)
    tightened, packed = tighten_layers(model, chosen, rotate=policy.ep == "cpu")
    notes += tightened
    from_shapes = bool(shared) and rows is not None \
        and length_from_shapes(model.graph, rows, set(pairs))
    if policy.kv_cache == "shared":
        notes.append(shared_note(shared, chosen, rows, from_shapes))
    model.opset_imports.setdefault(MS_DOMAIN, 1)
    if not pairs:
        return None, packed
    cache: dict = {"form": "shared" if shared else "appended", "pairs": pairs}
    if shared and rows is not None:  # each buffer row holds that row's kept keys first
        cache["rows"] = rows.to_dict()
    if shared:  # where the cached length comes from
        cache["past_length"] = "mask - ids" if from_shapes else LENGTH_INPUT
    return cache, packed


def _normalise(model: ir.Model) -> list[str]:
    """Repairs ORT needs, and attention spelt so that each Softmax is one block; notes."""
    notes = []
    repaired: list[str] = []
    windows: list[str] = []
    RewriteRuleSet([RotaryCachesOverBatch.rule(repaired),
                    *window_mask_rules(windows)]).apply_to_model(model)
    if repaired:
        notes.append(f"repaired {len(repaired)} RotaryEmbedding node(s) that onnxruntime 1.31 "
                     "refuses (cos/sin caches broadcast over the batch, now expanded)")
    if windows:
        remove_unused_nodes(model)  # the views and their Adds
        notes.append(f"{len(windows)} mask(s) added on a view of the scores with one more "
                     "axis (Swin's [B, windows, heads, N, N], DETR's [B, heads, T, S]) made a "
                     "bias on the scores")
    merged = merge_value_matmuls(model) + distribute_combinations(model)
    if merged:
        remove_unused_nodes(model)  # the scaled weights now read by nothing
        notes.append(f"{merged} differential attention(s) (Softmax weights applied to several "
                     "value tensors, or combined before V) made one attention per Softmax")
    return notes


def understand(model_proto: onnx.ModelProto) -> dict[str, str]:
    """What fuse would make of each unfused attention block, without rewriting anything:
    block name -> its meaning (e.g. "causal + key padding, window 4") or "not fused: why"."""
    specs = input_specs(model_proto)
    related = with_related_dims(model_proto, specs)  # one name per axis
    model = to_ir(with_symbolic_shapes(related))
    _prepare(model, "ort")
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
    target: str = "ort",
    verify_result: bool = True,
    force: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    forms: Forms | None = None,
    inputs: str | Path | None = None,
    kv_cache: str | None = None,
    strict: bool = False,
    genai: bool = True,
    logits: str = "all",
) -> FuseReport:
    """Fuse ``source`` into ``output``; refuses to write when the fused graph's outputs differ
    from the original's beyond tolerance (unless ``verify_result`` is False). ``inputs``: an
    .npz of real inputs to verify with instead of generated ones. ONNX Runtime first meets
    each model in a child process, so a crash in it cannot take this process down. A
    decoder whose folder holds a HF config.json (Optimum's output) records it and, with
    ``genai``, gets genai_config.json and the folder's tokenizer files beside ``output``.
    ``logits="last"``: the LM head computes each row's last kept position only
    (last_logits.py), checked against the original before fusing."""
    started = time.perf_counter()
    output = prepare_output(output, force=force)
    original = read_model(source)
    given = load_inputs(inputs, input_specs(original)) if inputs is not None else None
    level = _safe_level(preflight(source), "the original model") if verify_result else "all"
    original, notes = _logits(original, logits)
    fused, results, more = fuse_model(original, target=target, forms=forms, kv_cache=kv_cache)
    notes += more
    carry_metadata(original, fused, results, target, (forms or Forms()).ep)
    notes += _unused_overrides(forms, results)
    unguarded = unguarded_norms(original)
    if unguarded:
        notes.append(_UNGUARDED.format(len(unguarded), unguarded[0]))
    notes += _blocks_left(results, strict)
    checked = preflight(fused.SerializeToString())
    fused_level = _safe_level(checked, "the fused model")
    if checked.crashed:
        metadata.write(fused, {"session": {"optimization": fused_level}})
        notes.append(f"{checked.message()}; recorded in the fused model for validate and profile")
    verification = None
    if verify_result:
        cases = None if given is not None else verification_cases(original, results)
        verification = verify(original, fused, cases=cases, given=given, atol=atol, rtol=rtol,
                              levels=(level, fused_level))
        if target == "openvino":
            verification = verify_on_openvino(original, fused, verification, cases=cases,
                                              given=given, atol=atol, rtol=rtol)
        refuse_mismatch(verification, unguarded)
    notes += _write(source, original, fused, output, target, force, genai)
    return FuseReport(
        input=str(source), output=str(output), target=target, blocks=tuple(results),
        verification=verification, seconds=time.perf_counter() - started, written=True,
        notes=tuple(notes),
    )


def _write(source, original: onnx.ModelProto, fused: onnx.ModelProto, output: Path,
           target: str, force: bool, genai: bool) -> list[str]:
    """Write the fused model: (ORT target) its original kept inside for `mha-onnx tune` on
    another machine; a decoder's HF config recorded and, with ``genai``, GenAI's folder
    beside it. Returns the notes."""
    from mha_onnx.generate.genai import folder_generation, write_genai_folder

    if target == "ort":
        record_original(original, fused)
    decoder = folder_generation(source, fused)  # a decoder's HF config (Optimum's folder)
    write_model(fused, output, force=force)
    if decoder and genai and target == "ort":
        return [write_genai_folder(output, Path(source).parent, decoder).note()]
    return []


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


def _unused_overrides(forms: Forms | None, results: list[BlockResult]) -> list[str]:
    """A --form for a mask kind no block has is said, not silently accepted."""
    kinds = {r.mask for r in results if r.status == "fused"}
    return [f"--form {kind}=... matched no block (the model has no {kind.replace('_', ' ')} "
            "block)" for kind in (forms.given if forms else ()) if kind != "kv_cache"
            and kind not in kinds]


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
