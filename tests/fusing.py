"""Helpers shared by the fusion tests: the ops of a model (subgraphs included) and a fuse
that checks structure (valid model, nothing unfused left) and numbers (verified)."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from mha_onnx.graph.files import for_checker
from mha_onnx.rewrite import fuse_model
from mha_onnx.rewrite.check.cases import verification_cases
from mha_onnx.rewrite.check.verify import verify
from mha_onnx.rewrite.inspect import summarize
from mha_onnx.rewrite.irutil import FORM, all_graphs
from mha_onnx.rewrite.policy import FormPolicy


def ops(model: onnx.ModelProto) -> list[str]:
    graph = ir.from_proto(model).graph
    return [n.op_type for g in all_graphs(graph) for n in g]


def fused_and_checked(model: onnx.ModelProto, target: str = "ort"):
    fused, results, _ = fuse_model(model, FormPolicy(target=target))
    # types declared, subgraphs included; ORT's own default-domain ops (the norm kernels) as
    # ORT registers them, not refused for being outside ONNX's registry
    onnx.checker.check_model(for_checker(fused), full_check=True)
    summary = summarize(fused)
    assert summary.unfused_blocks == 0, [b for b in summary.blocks if b.kind == "unfused"]
    # no Softmax left but those of a form written out (soft-capped scores GQA does not take)
    graph = ir.from_proto(fused).graph
    assert all(FORM in n.metadata_props for g in all_graphs(graph) for n in g
               if n.op_type == "Softmax")
    result = verify(model, fused, cases=verification_cases(model, results))  # every branch
    assert result.passed, result.first_failure()
    return fused, results
