"""Stage 2 for ``--target ort`` as rewrite rules: every Sdpa onto its kernel (ort.lower_ort).

One rule class, four rules, by what a rule replaces:

- ``merged``: Reshape(Transpose(Sdpa, [0, 2, 1, 3]), [B, S, H*Dv]) becomes the kernel's 3-D
  output directly; otherwise the Sdpa, its output put back to [B, H, S, Dv];
- ``cached``: K and V are a layer's appended caches (Concat(past, new), also the model's
  presents; lowered.present_caches): the rule returns those Concats too, now the kernel's
  presents, so a decode step does not copy the cache outside the kernel (where the form
  runs a kernel with past and present: ort.takes_presents; else the plain rule applies).

The caches are tried first; :func:`lower_to_ort` runs them all and returns what each made.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import onnx_ir as ir
from onnxscript.optimizer import remove_unused_nodes
from onnxscript.rewriter import MatchResult, RewriteRuleSet, pattern

from mha_onnx.rewrite.forms import Form
from mha_onnx.rewrite.irutil import all_graphs, dims, same_dim
from mha_onnx.rewrite.lower.lowered import Lowered, prepare_caches, present_caches
from mha_onnx.rewrite.lower.ort import lower_ort, takes_presents
from mha_onnx.rewrite.policy import FormPolicy
from mha_onnx.rewrite.sdpa import FUSION_DOMAIN, SdpaInfo, from_bsd


@dataclass
class Stage2:
    """What the rules made: the form of each block, and the layers whose presents their
    kernels return (in the order lowered)."""

    forms: dict[str, Form] = field(default_factory=dict)
    layers: list[Lowered] = field(default_factory=list)

    def pairs(self, graph: ir.Graph) -> dict[str, str]:
        """{past input: present output} of the layers whose past is a model input and whose
        present a model output (by name)."""
        outputs = {id(v) for v in graph.outputs}
        pairs = {}
        for layer in self.layers:
            assert layer.caches is not None and layer.presents is not None
            for cache, present in zip(layer.caches, layer.presents, strict=True):
                if cache.past.is_graph_input() and cache.past.graph is graph \
                        and id(present) in outputs:
                    pairs[cache.past.name] = present.name
        return pairs


def lower_to_ort(model: ir.Model, policy: FormPolicy) -> Stage2:
    """Every Sdpa of the model (subgraphs included) onto ONNX Runtime's kernels."""
    for graph in all_graphs(model.graph):
        for node in list(graph):
            if node.op_type == "Sdpa" and node.domain == FUSION_DOMAIN \
                    and takes_presents(SdpaInfo.of(node), policy):
                prepare_caches(graph, node)
    remove_unused_nodes(model)  # the Shapes and Transposes prepare_caches replaced
    stage = Stage2()
    for merged in (True, False):
        RewriteRuleSet([LowerSdpa.rule(stage, policy, merged=merged, cached=True),
                        LowerSdpa.rule(stage, policy, merged=merged, cached=False)]
                       ).apply_to_model(model)
    return stage


class LowerSdpa(pattern.RewriteRuleClassBase):
    """Sdpa -> kernel (see the module's docstring for ``merged`` and ``cached``)."""

    def __init__(self, stage: Stage2, policy: FormPolicy, *, merged: bool, cached: bool) -> None:
        super().__init__("LowerSdpa" + ("Merged" if merged else "") + ("Cached" if cached else ""))
        self.stage, self.policy, self.merged, self.cached = stage, policy, merged, cached

    def pattern(self, op, q, k, v, past_k, new_k, past_v, new_v, shape):
        if self.cached:
            k = op.Concat(past_k, new_k, _allow_other_attributes=True, _outputs=["present_k"])
            v = op.Concat(past_v, new_v, _allow_other_attributes=True, _outputs=["present_v"])
        out = op.Sdpa(q, k, v, _domain=FUSION_DOMAIN, _allow_other_inputs=True,
                      _allow_other_attributes=True, _outputs=["sdpa"])
        if self.merged:
            out = op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), shape,
                             _allow_other_attributes=True, _outputs=["merged"])
        return (out, k, v) if self.cached else out

    def check(self, context, sdpa, merged=None, **_):
        result = MatchResult()
        node = sdpa.producer()
        if self.cached and (present_caches(node.inputs[1], node.inputs[2], node) is None
                            or not takes_presents(SdpaInfo.of(node), self.policy)):
            return result.fail("K and V are not appended caches that only this block reads, "
                               "or its form reads them as they are")
        if self.cached and SdpaInfo.of(node).dk != SdpaInfo.of(node).dv:
            # (DeepSeek's MLA: ORT's kernels with past take one head size for both pasts;
            # the step runs over the concatenated cache instead)
            return result.fail("V's head size is not K's: no kernel with past takes them")
        if merged is None:
            return result
        info = SdpaInfo.of(node)
        out, src = dims(merged), dims(sdpa)
        if out is None or src is None or len(out) != 3 or len(src) != 4:
            return result.fail("merged output shape unknown")
        if not (same_dim(out[0], src[0]) and same_dim(out[1], src[2])
                and out[2] == info.heads * info.dv):
            return result.fail("reshape does not merge heads into [B, S, H*Dv]")
        return result

    def rewrite(self, op, sdpa, **_):
        node = sdpa.producer()
        info = SdpaInfo.of(node)
        caches = present_caches(node.inputs[1], node.inputs[2], node) if self.cached else None
        lowered = lower_ort(op, node, self.policy, caches)
        self.stage.forms[info.block] = with_keys(lowered.form, info)
        out = lowered.out if self.merged else from_bsd(op, lowered.out, info.heads)
        if caches is None:
            return out
        assert lowered.presents is not None, info.block  # (takes_presents)
        for cache in caches:  # the new nodes read the pasts and new keys, never the Concats
            assert all(user is node for user, _ in cache.concat.uses()), info.block
        self.stage.layers.append(lowered)
        return (out, *lowered.presents)


def with_keys(form: Form, info: SdpaInfo) -> Form:
    """``form`` knowing its key length as an expression of input dims, where it has length
    switches and the keys are not an input dim (Form.keys)."""
    shape = dims(info.key)
    length = shape[2] if shape is not None and len(shape) == 4 else None
    if not form.switches() or not isinstance(length, str) or length.isidentifier():
        return form
    return replace(form, keys=length)

