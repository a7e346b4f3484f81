"""onnxscript's optimizer, minus the rules that change what a graph computes.

``onnxscript.optimizer.optimize`` (which ``torch.onnx.export(optimize=True)`` runs too) removes
``x + c``, ``x - c``, ``x * c`` and ``x / c`` for a scalar ``c`` that is only *close* to 0 or
1 (abs_tol 1e-8, rel_tol 1e-5): an RMS normalisation's ``mean(x^2) + 1e-8`` (Helium,
``rms_norm_eps=1e-8``) loses its epsilon, and a row of zeros (a padding token's embedding)
then gives ``0 * inf = NaN`` where PyTorch gives 0. Here the same passes run with those four
rules replaced by exact ones: the identity element itself, nothing near it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import fold_constants_ir
from onnxscript.rewriter import MatchResult, RewritePass, RewriteRuleSet, pattern
from onnxscript.rewriter.rules import common as rules

from mha_onnx.rewrite.irutil import const_array

# onnxscript's default rule list (rewriter._DEFAULT_REWRITE_RULES) from its public names,
# without add_0/sub_0/mul_by_1/div_by_1, and without slice_split_rule: two Slices -> one Split
# is a pattern of two output nodes, which onnxscript 0.7 matches by walking the whole graph
# for every Slice (a third of fusing Swin's 480 KB file went there); no recogniser needs the
# Split (packing reads Slices or a Split, the rotations read Slices)
_KEPT = (
    rules.dropout_zero_rule, rules.dropout_inference_rule,
    rules.two_reshapes_matmul_reshape_rule, rules.one_reshape_matmul_reshape_rule,
    rules.cast_constant_of_shape_rule, rules.cast_constant_of_shape_without_value_rule,
    rules.collapse_slice_rule, rules.collapse_slice2_rule, rules.materialize_reshape_shape_rule,
    rules.min_min_rule, rules.max_max_rule, rules.min_max_rule, rules.max_min_rule,
    rules.successive_clip_relu_rule, rules.successive_relu_clip_rule, rules.successive_relu_rule,
    rules.successive_clip_rule,
    rules.cast_cast_rule, rules.no_op_cast_rule, rules.no_op_expand_rule,
    rules.flatten_to_reshape_rule, rules.reshape_reshape_rule,
    rules.no_op_transpose_rule, rules.transpose_transpose_rule, rules.unsqueeze_unsqueeze_rule,
    rules.squeeze_reshape_1d_rule,
    rules.no_op_dynamic_scatter_nd_rule, rules.no_op_static_scatter_nd_rule,
    rules.fuse_pad_into_conv_rule, rules.fuse_pad_into_conv_integer_rule,
    rules.normalize_pad_format_conv_rule, rules.normalize_pad_format_conv_integer_rule,
    rules.fuse_batchnorm_into_conv_rule, rules.fuse_batchnorm_into_conv_transpose_rule,
    rules.fuse_batchnorm_into_gemm_rule,
    rules.remove_optional_bias_from_conv_rule, rules.remove_optional_bias_from_conv_transpose_rule,
    rules.remove_optional_bias_from_qlinear_conv_rule, rules.remove_optional_bias_from_gemm_rule,
)

_IDENTITY = {"Add": 0.0, "Sub": 0.0, "Mul": 1.0, "Div": 1.0}


class ExactNoOp(pattern.RewriteRuleClassBase):
    """``x op c`` -> ``x`` where ``c`` is a scalar (rank 0) constant equal to the op's
    identity element exactly (so the shape and every value of ``x`` are kept)."""

    def __init__(self, op_type: str, constant_first: bool) -> None:
        super().__init__(f"Exact{op_type}NoOp{'Swapped' if constant_first else ''}")
        self.op_type, self.constant_first = op_type, constant_first

    def pattern(self, op, x, c):
        args = (c, x) if self.constant_first else (x, c)
        return getattr(op, self.op_type)(*args)

    def check(self, context, x, c, **_) -> MatchResult:
        result = MatchResult()
        value = const_array(c)
        if value is None or value.ndim != 0 or c.dtype != x.dtype:
            return result.fail("not a scalar constant of the same type")
        if not np.array_equal(value.astype(np.float64), _IDENTITY[self.op_type]):
            return result.fail(f"{value} is not exactly {_IDENTITY[self.op_type]}")
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


def _exact_rules() -> list:
    commutes = ("Add", "Mul")
    return [ExactNoOp.rule(t, first) for t in _IDENTITY
            for first in ((False, True) if t in commutes else (False,))]


def register_orphans(model: ir.Model) -> int:
    """Register again the constants a rewrite made that no graph holds (onnxscript 0.7's
    rewriter keeps one initializer per name: ``Flatten2Reshape`` names its shape
    ``{input}/shape``, so two Flattens of one value - a mixture of experts' routing - left
    the second Reshape reading a value nothing produces, and ORT refused the graph; its issue
    2945). Each gets a name of its own; returns how many."""
    from mha_onnx.rewrite.irutil import all_graphs

    fixed = 0
    for graph in all_graphs(model.graph):
        for node in graph:
            for value in node.inputs:
                if value is None or value.producer() is not None or value.is_graph_input() \
                        or value.is_initializer() or value.const_value is None:
                    continue
                base, n = value.name or "orphan", 0
                taken = model.graph.initializers
                while value.name in taken or not value.name:
                    n += 1
                    value.name = f"{base}#{n}"
                model.graph.register_initializer(value)
                fixed += 1
    return fixed


def optimize_faithfully(model: ir.Model, num_iterations: int = 2) -> None:
    """Constant folding and onnxscript's clean-up rules, in place, keeping every value the
    graph computes (the sequence of ``onnxscript.optimizer.optimize_ir``, exact no-ops)."""
    common_passes.InlinePass()(model)
    rewrite = RewritePass(RewriteRuleSet([*_KEPT, *_exact_rules()]))
    for _ in range(num_iterations):
        folded = fold_constants_ir(model, onnx_shape_inference=True)
        rewritten = rewrite(model)
        register_orphans(model)
        common_passes.RemoveUnusedNodesPass()(model)
        if not (folded.modified or rewritten.modified):
            break
    for step in (common_passes.RemoveUnusedFunctionsPass(), common_passes.RemoveUnusedOpsetsPass(),
                 common_passes.LiftConstantsToInitializersPass(lift_all_constants=True,
                                                               size_limit=0),
                 common_passes.LiftSubgraphInitializersToMainGraphPass(),
                 common_passes.DeduplicateInitializersPass(),
                 common_passes.CommonSubexpressionEliminationPass(),
                 common_passes.OutputFixPass(), common_passes.NameFixPass()):
        step(model)
