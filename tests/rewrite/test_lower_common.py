"""lower_common.clone_into: which outer values a branch reads and which it recomputes."""

from __future__ import annotations

import onnx_ir as ir

from mha_onnx.rewrite.lower.common import TapeOps, clone_into


def _graph():
    """mask [B, T] -> Flatten -> Gather(idx) -> a flat [N] mask (symbolic N, as TorchScript
    builds a 4-D mask), plus Shape(x) of an input and a Shape of a tensor made only for it."""
    mask = ir.Value(name="mask", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["B", "T"]))
    idx = ir.Value(name="idx", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["N"]))
    ops = TapeOps()
    flat = ops.Reshape(mask, ops.Constant(value_ints=[-1]))
    flat.shape = ir.Shape(["BT"])
    picked = ops.Gather(flat, idx)
    picked.shape = ir.Shape(["N"])
    grid = ops.Add(idx, idx)
    grid.shape = ir.Shape(["N"])
    grid_shape = ops.Shape(grid)
    grid_shape.shape = ir.Shape([1])
    input_shape = ops.Shape(mask)
    input_shape.shape = ir.Shape([2])
    ir.Graph([mask, idx], [picked, grid_shape, input_shape], nodes=ops.tape.nodes)
    return picked, grid_shape, input_shape


def test_a_flat_mask_of_symbolic_length_is_recomputed_in_the_branch():
    picked, _, _ = _graph()
    ops = TapeOps()
    copy = clone_into(ops, picked)
    assert copy is not picked and copy.producer().op_type == "Gather"
    assert {n.op_type for n in ops.tape.nodes} >= {"Gather", "Reshape"}


def test_shapes_are_read_from_outside_unless_their_tensor_exists_only_for_them():
    _, grid_shape, input_shape = _graph()
    ops = TapeOps()
    assert clone_into(ops, input_shape) is input_shape  # the shape of an input: free
    copy = clone_into(ops, grid_shape)  # Shape(idx + idx): the Add would run for it alone
    assert copy is not grid_shape and {n.op_type for n in ops.tape.nodes} == {"Add", "Shape"}
