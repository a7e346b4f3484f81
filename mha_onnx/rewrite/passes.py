"""Fusion as an ordered list of passes: what ``fuse_model`` runs, per target.

Each stage is an onnx-ir ``InPlacePass`` with its settings in ``__init__`` (the policy,
policy.py, and the facts earlier passes found); ``requires`` checks that it is on its
target's list and that the facts it ``NEEDS`` were given by an earlier pass, ``call``
returns a ``FusionResult`` (what it counted, the notes users read, and the facts with those
it ``GIVES`` added: a new ``Facts``, never an edit of the one it was given), ``ensures``
checks that it gave them. ``run_pipeline`` runs the list as onnx-ir's PassManager would,
each pass made with the facts of the one before: a list in the wrong order stops at the
first pass whose facts are missing, by name.

    prepare -> normalise -> recognise -> lower (ORT | ONNX) -> tighten -> cache record -> tidy

``pipeline(policy)`` gives the list. The ORT target lowers onto ORT's contrib kernels and
tightens the layer around them (below); passes measured on the CPU kernels only (residual
Sum, rotary fold, packed Q/K/V) are listed for ``ep == "cpu"`` alone: what a GPU gets is read
off the list. The ONNX target (and OpenVINO: the same ops) lowers onto ONNX's Attention.

Tightening the rest of the layer (a decode step's time once attention is fast), in order:
RMS norms onto SimplifiedLayerNormalization, for the CPU residual Adds before a float32
LayerNormalization as Sum (norms.py); the exporter's rotary folded into GQA, its Q/K/V
projections packed into one MatMul (rotary_fold.py, packing.py); the guards (Guards, below); any
other GQA's projections packed (packing.py; after the sinking, a branch's own copies are
what its kernel alone reads). The guards' cost: tools/experiments/guard_cost.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import remove_unused_nodes
from onnxscript.rewriter import RewriteRuleSet

from mha_onnx.graph.cache import LENGTH_INPUT
from mha_onnx.rewrite.blocks import find_blocks
from mha_onnx.rewrite.faithful import optimize_faithfully
from mha_onnx.rewrite.forms import rotating_kernels
from mha_onnx.rewrite.fusion_pass import Facts, FusionPass
from mha_onnx.rewrite.irutil import MS_DOMAIN, all_graphs, opset
from mha_onnx.rewrite.kv_interface import shared_note
from mha_onnx.rewrite.lower.attention import ONNX_ATTENTION_OPSET, LowerToOnnxAttention
from mha_onnx.rewrite.lower.rules import lower_to_ort
from mha_onnx.rewrite.lower.shared import length_from_shapes, share_interface, shared_rows
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.prepare.einsums import BLOCKED_NOTE, blocked_einsums
from mha_onnx.rewrite.prepare.repairs import RotaryCachesOverBatch
from mha_onnx.rewrite.prepare.shapes import fold_static_dims, probability_shapes
from mha_onnx.rewrite.prepare.shared_probs import distribute_combinations, merge_value_matmuls
from mha_onnx.rewrite.prepare.windows import window_mask_rules
from mha_onnx.rewrite.recognise.attention_sinks import SCALED_NOTE, scaled_sink_rules
from mha_onnx.rewrite.recognise.core import BlockLog, OnnxAttention, SoftmaxAttention
from mha_onnx.rewrite.recognise.oracle import Oracle
from mha_onnx.rewrite.sdpa import FUSION_DOMAIN
from mha_onnx.rewrite.tighten.into_branches import (
    hoist_by_condition,
    merge_nested_guards,
    sink_into_branches,
)
from mha_onnx.rewrite.tighten.norms import fuse_norms, omit_unread_outputs, residual_sums
from mha_onnx.rewrite.tighten.opset_fit import fit_to_opset
from mha_onnx.rewrite.tighten.packing import pack_kernel_inputs
from mha_onnx.rewrite.tighten.rotary_fold import fold_rotary
from mha_onnx.rewrite.tighten.tidy import share_guards

log = logging.getLogger(__name__)

ROTATING_NOTE = ("{} block(s) rotate Q and K inside GroupQueryAttention (do_rotary, with cos/sin "
                 "tables of {} positions taken from the graph's own rotation) where a run's "
                 "positions allow it (inside the tables; a prompt's counted up from the "
                 "first row's); other runs take the exporter's rotation")


class Prepare(FusionPass):
    """Functions inlined, node names unique over the model (subgraphs included), the opset
    raised for ONNX's Attention (ONNX target), shapes inferred, static dims read by Shape
    chains folded, Softmax outputs' dims read elsewhere named, then onnxscript's optimizer
    without the rules that change what a value computes (faithful.py)."""

    NOTES = {"upgraded_from": "opset upgraded {n} -> " + str(ONNX_ATTENTION_OPSET)
             + " for the ONNX Attention op"}

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        counts = {"inlined": len(model.functions)}
        if model.functions:
            common_passes.InlinePass()(model)
        counts["renamed"] = unique_node_names(model)
        if self.target == "onnx" and opset(model) < ONNX_ATTENTION_OPSET:
            from onnxscript.version_converter import convert_version

            counts["upgraded_from"] = opset(model)
            convert_version(model, ONNX_ATTENTION_OPSET, fallback=True)
            model.opset_imports[""] = ONNX_ATTENTION_OPSET
        try:
            common_passes.ShapeInferencePass()(model)
        except Exception as exc:  # noqa: BLE001 - shapes only help; rules fail without them
            log.warning("shape inference failed (%s); fusing with the shapes in the file", exc)
        counts["static_dims"] = fold_static_dims(model)
        counts["probability_shapes"] = probability_shapes(model)
        try:  # constant folding: masks that are constant (e.g. all-keep) become visible
            optimize_faithfully(model)
        except Exception as exc:  # noqa: BLE001 - optional clean-up
            log.warning("onnxscript optimizer failed (%s); fusing the graph as it is", exc)
        return counts, {}


def unique_node_names(model: ir.Model) -> int:
    """One identity per block: node names unique over the model, subgraphs included (an
    Optimum merged decoder's two If branches name their nodes alike); a repeated name gets
    its graph's name (the branch) after it. Returns how many were renamed."""
    seen: set[str] = set()
    renamed = 0
    for graph in all_graphs(model.graph):
        for node in graph:
            name = node.name or node.op_type
            if name in seen:
                base, n = f"{name}@{graph.name or 'subgraph'}", 1
                name = base
                while name in seen:
                    n += 1
                    name = f"{base}#{n}"
                renamed += 1
            node.name = name
            seen.add(name)
    return renamed


class Normalise(FusionPass):
    """Repairs ORT needs and attention spelt so that each Softmax is one block: RotaryEmbedding
    caches over the batch expanded, masks on a view of the scores made biases on them
    (windows.py), a sink scaling the output a column of the scores (attention_sinks.py), weights applied
    to several values one attention each, Einsum attention over blocks 4-D MatMuls (einsums.py)."""

    NOTES = {
        "repaired": "repaired {n} RotaryEmbedding node(s) that onnxruntime 1.31 refuses "
                    "(cos/sin caches broadcast over the batch, now expanded)",
        "views": "{n} mask(s) added on a view of the scores with one more axis (Swin's [B, "
                 "windows, heads, N, N], DETR's [B, heads, T, S]) made a bias on the scores "
                 "(on the CPU a Swin-T stage ran 1.03-1.15x slower fused, docs/families.md: "
                 "`mha-onnx tune` keeps the original where it is faster)",
        "scaled_sinks": SCALED_NOTE,
        "shared_probabilities": "{n} differential attention(s) (Softmax weights applied to "
                                "several value tensors, or combined before V) made one "
                                "attention per Softmax",
        "blocked": BLOCKED_NOTE}

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        repaired, windows, scaled = [], [], []  # type: ignore[var-annotated]
        RewriteRuleSet([RotaryCachesOverBatch.rule(repaired), *window_mask_rules(windows),
                        *scaled_sink_rules(scaled)]).apply_to_model(model)
        if windows or scaled:
            remove_unused_nodes(model)  # the views and their Adds, the logsumexp
        merged = merge_value_matmuls(model) + distribute_combinations(model)
        blocked = blocked_einsums(model)
        if merged or blocked:
            remove_unused_nodes(model)  # the scaled weights, the Einsums now read by nothing
        return {"repaired": len(repaired), "views": len(windows), "scaled_sinks": len(scaled),
                "shared_probabilities": merged, "blocked": blocked}, {}


class Recognise(FusionPass):
    """Every attention block (a Softmax between Q·K^T and ·V, or ONNX's Attention) whose mask
    is proven by evaluation becomes the internal Sdpa node (core.py); the others keep a
    reason in the block log. The blocks as found before are kept for the report."""

    GIVES = ("before", "blog")

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        before, blog = tuple(find_blocks(model.graph)), BlockLog()
        oracle = Oracle(model, floors=self.floors)
        RewriteRuleSet([SoftmaxAttention.rule(blog, opset(model), oracle, self.policy)]
                       ).apply_to_model(model)
        RewriteRuleSet([OnnxAttention.rule(blog, oracle, self.policy)]).apply_to_model(model)
        remove_unused_nodes(model)
        return ({"blocks": len(before), "recognised": len(blog.matched)},
                {"before": before, "blog": blog})


class LowerToOrt(FusionPass):
    """Sdpa onto ORT's kernels (GroupQueryAttention, MultiHeadAttention, the Loop form), each
    block's form chosen by the policy (lower/rules.py); with ``kv_cache="shared"`` the KV
    interface made max-length buffers (lower/shared.py)."""

    TARGETS = ("ort",)
    GIVES = ("chosen", "pairs", "rows", "shared")

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        stage = lower_to_ort(model, self.policy)
        pairs = stage.pairs(model.graph)
        found = {"chosen": {**self.facts.chosen, **stage.forms}, "pairs": pairs,
                 "rows": shared_rows(stage.layers),
                 "shared": share_interface(model.graph, stage.layers)}
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        return {"lowered": len(stage.forms), "cache_pairs": len(pairs)}, found


class LowerToOnnx(FusionPass):
    """Sdpa onto ONNX's Attention (opset 23), K/V heads repeated for OpenVINO."""

    TARGETS = ("onnx",)
    GIVES = ("chosen",)

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        chosen = dict(self.facts.chosen)  # (the rule adds each block's form)
        RewriteRuleSet([LowerToOnnxAttention.rule(chosen, self.policy.ungroup)]
                       ).apply_to_model(model)
        return {"lowered": len(chosen) - len(self.facts.chosen)}, {"chosen": chosen}


class FuseNorms(FusionPass):
    """RMS normalisations (with the residual Add before them) onto ORT's
    SimplifiedLayerNormalization kernels (norms.py)."""

    TARGETS = ("ort",)
    NOTES = {"norms": "{n} RMS normalisation(s) (with the residual Add where there is one) "
                      "onto ORT's SimplifiedLayerNormalization kernels"}

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        return {"norms": fuse_norms(model)}, {}


class ResidualSums(FusionPass):
    """Residual Adds before a float32 LayerNormalization written as Sum, so that ORT does not
    fuse them into SkipLayerNormalization (slower on the CPU; a GPU's fast kernel)."""

    TARGETS, EPS = ("ort",), ("cpu",)
    NOTES = {"sums": "{n} residual Add(s) before a float32 LayerNormalization written as Sum: "
                     "ORT would fuse them into SkipLayerNormalization, 1.5-5.5x slower on the "
                     "CPU"}

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        return {"sums": residual_sums(model)}, {}


class FoldRotary(FusionPass):
    """The exporter's rotary folded into GroupQueryAttention (do_rotary) and its Q/K/V
    projections packed into one MatMul the kernel reads whole (rotary_fold.py); measured on the
    CPU kernel only (how a GPU's kernel reads position_ids never was)."""

    TARGETS, EPS = ("ort",), ("cpu",)
    NOTES = {"packed_groups": "{n} Q/K/V projection(s) packed into one MatMul each, read whole "
                              "by the kernel that rotates them"}

    NEEDS = ("chosen",)
    GIVES = ("rotating", "packed", "chosen")

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        rotating = fold_rotary(model)
        chosen = dict(self.facts.chosen)
        for block, positions in rotating.blocks.items():
            if block in chosen:  # (a kernel node not lowered from a recognised block)
                chosen[block] = rotating_kernels(chosen[block], positions,
                                                 step=block in rotating.steps,
                                                 prompt=block in rotating.prompts)
        return ({"packed_groups": len({name for name, _, _ in rotating.packed.values()}),
                 "rotating": len(rotating.blocks)},
                {"rotating": rotating, "packed": {**self.facts.packed, **rotating.packed},
                 "chosen": chosen})

    def notes(self, counts: Mapping[str, int], found: Mapping[str, Any]) -> list[str]:
        rows = " / ".join(map(str, found["rotating"].rows))
        return super().notes(counts, found) + (
            [ROTATING_NOTE.format(counts["rotating"], rows)] if counts.get("rotating") else [])


class Guards(FusionPass):
    """The guards tidied (into_branches.py, tidy.py): a shared cache's past length read from the shapes
    (GenAI's contract) first, a guard nested in a guard's fast branch merged into one, every
    layer's guard computed once, what only a guarded branch reads moved into it, what only the
    general branches read (that length too) behind one If."""

    TARGETS = ("ort",)
    NEEDS = ("pairs", "rows", "shared")  # (and what FoldRotary folded, where it ran)
    GIVES = ("from_shapes",)

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        facts = self.facts
        from_shapes = bool(facts.shared) and facts.rows is not None and length_from_shapes(
            model.graph, facts.rows, set(facts.pairs))
        merge_nested_guards(model.graph)
        share_guards(model)  # (also drops the readers the rewrites left)
        sink_into_branches(model.graph, facts.rotating.copyable(model.graph))
        hoist_by_condition(model.graph)
        return {}, {"from_shapes": from_shapes}


class PackKernelInputs(FusionPass):
    """Any other GQA's projections packed into one MatMul, Q, K and V read as one tensor
    (packing.py; after the guards: a branch's own copies are what its kernel alone reads)."""

    TARGETS, EPS = ("ort",), ("cpu",)
    NOTES = {"kernels": "{n} GroupQueryAttention kernel(s) read Q, K and V as one packed "
                        "tensor (their projections joined into one MatMul, or the exporter's "
                        "own before its split)"}

    GIVES = ("packed",)

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        kernels, plain = pack_kernel_inputs(model)
        packed = {**self.facts.packed, **(plain if kernels else {})}
        return {"kernels": kernels}, {"packed": packed}


class RecordCache(FusionPass):
    """The KV-cache record the fused model carries (past -> present, the cache form, each
    buffer row's layout, the past length's source) and the note on ``kv_cache="shared"``."""

    TARGETS = ("ort",)
    NEEDS = ("chosen", "pairs", "rows", "shared", "from_shapes")
    GIVES = ("cache",)

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        facts = self.facts
        pairs, rows, shared = dict(facts.pairs), facts.rows, facts.shared
        if not pairs:
            return {"pairs": 0}, {"cache": None}
        cache: dict = {"form": "shared" if shared else "appended", "pairs": pairs}
        if shared and rows is not None:  # each buffer row holds that row's kept keys first
            cache["rows"] = rows.to_dict()
        if shared:  # where the cached length comes from
            cache["past_length"] = "mask - ids" if facts.from_shapes else LENGTH_INPUT
        return {"pairs": len(pairs), "shared": int(shared)}, {"cache": cache}

    def notes(self, counts: Mapping[str, int], found: Mapping[str, Any]) -> list[str]:
        facts = self.facts
        note = shared_note(facts.shared, facts.chosen, facts.rows, facts.from_shapes) \
            if self.policy.kv_cache == "shared" else None
        return [note] if note else []


class FitToOpset(FusionPass):
    """Nodes the lowering wrote in a newer spelling than the model's opset allows written in
    the older one (opset_fit.py): a TorchScript export at opset 14-17 keeps its opset."""

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        return {"fitted_to_opset": fit_to_opset(model)}, {}


class Tidy(FusionPass):
    """The internal domain dropped, nodes nothing reads removed, names fixed, outputs nothing
    reads left unwritten (LayerNormalization's mean and inverse deviation)."""

    def apply(self, model: ir.Model) -> tuple[dict[str, int], dict[str, Any]]:
        model.opset_imports.pop(FUSION_DOMAIN, None)
        remove_unused_nodes(model)
        common_passes.NameFixPass()(model)
        omit_unread_outputs(model.graph)
        return {}, {}


ORT_PASSES = (Prepare, Normalise, Recognise, LowerToOrt, FuseNorms, ResidualSums,
              FoldRotary, Guards, PackKernelInputs, RecordCache, FitToOpset, Tidy)
ONNX_PASSES = (Prepare, Normalise, Recognise, LowerToOnnx, FitToOpset, Tidy)


def pipeline(policy: FormPolicy) -> list[type[FusionPass]]:
    """The passes of ``policy``'s target, in order; those for other execution providers left
    out (a GPU's list has no residual Sum, rotary fold or packed Q/K/V)."""
    kinds = ORT_PASSES if policy.lowering == "ort" else ONNX_PASSES
    return [kind for kind in kinds if policy.runs_pass(kind.EPS)]


def run_pipeline(model: ir.Model, policy: FormPolicy | None = None, *,
                 floors: Mapping | None = None, kinds: list[type[FusionPass]] | None = None,
                 facts: Facts | None = None) -> tuple[Facts, list[str]]:
    """Every pass of ``pipeline(policy)`` (or ``kinds``) on ``model`` (in place), each made
    with the facts the passes before it gave (``facts``: those known before the first); the
    facts at the end and the notes."""
    policy = policy or FormPolicy()
    facts, notes = facts or Facts(), []
    for kind in kinds if kinds is not None else pipeline(policy):
        result = kind(policy, facts, floors=floors)(model)
        facts, notes = result.facts, notes + list(result.notes)
    return facts, notes
