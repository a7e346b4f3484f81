"""After the blocks are lowered onto ONNX Runtime's kernels: the rest of the layer, where a
decode step's time goes once attention is fast.

In order: RMS norms onto SimplifiedLayerNormalization and, for the CPU, residual Adds before
a float32 LayerNormalization written as Sum (norms.py); the exporter's rotary
folded into GroupQueryAttention, its Q/K/V projections packed into one MatMul the kernel
reads whole (rotary.py, packing.py); a guard nested in a guard's fast branch merged into one
condition (sink.py); every layer's guard computed once (tidy.py); what only a guarded branch
reads moved into it, and what only every layer's general branch reads computed behind one
If (sink.py); last, any other GroupQueryAttention's projections packed too (packing.py,
after the sinking: a branch's own copies are what its kernel alone reads). A decode
step of the Optimum Llama in docs/bench.md runs 48 kernels (the export: 269; ORT GenAI's
hand-built graph: 29).
"""

from __future__ import annotations

import onnx_ir as ir

from mha_onnx.rewrite.forms import Form, rotating_kernels
from mha_onnx.rewrite.norms import fuse_norms, residual_sums
from mha_onnx.rewrite.packing import pack_kernel_inputs
from mha_onnx.rewrite.rotary import Folded, fold_rotary
from mha_onnx.rewrite.sink import hoist_by_condition, merge_nested_guards, sink_into_branches
from mha_onnx.rewrite.tidy import share_guards

_ROTATING = ("{} block(s) rotate Q and K inside GroupQueryAttention (do_rotary, with cos/sin "
             "tables of {} positions taken from the graph's own rotation) where a run's "
             "positions allow it (inside the tables; a prompt's counted up from the first "
             "row's); other runs take the exporter's rotation")


def tighten_layers(model: ir.Model, chosen: dict[str, Form], *, rotate: bool = True
                   ) -> tuple[list[str], dict[str, tuple[str, int, int]]]:
    """The passes above on a lowered model; ``chosen`` (block -> form) updated where a
    block's form changed. ``rotate=False``: no rotary fold (forms for a GPU: how its
    GroupQueryAttention reads position_ids was measured on the CPU kernel only; no Sum for
    the residual either, as a GPU's SkipLayerNormalization is its fast kernel). Returns
    notes for the fuse report and where packed weights went (packing.pack)."""
    notes = []
    normed = fuse_norms(model)
    if normed:
        notes.append(f"{normed} RMS normalisation(s) (with the residual Add where there is "
                     "one) onto ORT's SimplifiedLayerNormalization kernels")
    summed = residual_sums(model) if rotate else 0
    if summed:
        notes.append(f"{summed} residual Add(s) before a float32 LayerNormalization written as "
                     "Sum: ORT would fuse them into SkipLayerNormalization, 1.5-5.5x slower on "
                     "the CPU")
    rotating = fold_rotary(model) if rotate else Folded({})
    packed = rotating.packed
    if packed:
        groups = len({packed_name for packed_name, _, _ in packed.values()})
        notes.append(f"{groups} Q/K/V projection(s) packed into one MatMul each, read whole "
                     "by the kernel that rotates them")
    for block, positions in rotating.blocks.items():
        if block in chosen:  # (a kernel node not lowered from a recognised block: no form)
            chosen[block] = rotating_kernels(chosen[block], positions,
                                             step=block in rotating.steps,
                                             prompt=block in rotating.prompts)
    if rotating.blocks:
        notes.append(_ROTATING.format(len(rotating.blocks),
                                      " / ".join(map(str, rotating.rows))))
    merge_nested_guards(model.graph)
    share_guards(model)  # (also drops the readers the rewrites left)
    sink_into_branches(model.graph, rotating.copyable(model.graph))
    hoist_by_condition(model.graph)
    kernels, plain = pack_kernel_inputs(model) if rotate else (0, {})
    if kernels:
        notes.append(f"{kernels} GroupQueryAttention kernel(s) read Q, K and V as one packed "
                     "tensor (their projections joined into one MatMul, or the exporter's own "
                     "before its split)")
        packed = {**packed, **plain}
    return notes, packed
