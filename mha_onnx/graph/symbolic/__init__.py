"""Symbolic shape inference of our own: every value's shape, with dims as integer arithmetic
on the inputs' symbols (``past_sequence_length + sequence_length``), and the values of the
small integer tensors that shapes are computed from.

TorchScript exports (Optimum's among them) carry no ``value_info`` and compute reshape targets
with ``Shape -> Gather -> Concat`` chains. ONNX's own inference follows such chains only where
every dim is a number, and carries no arithmetic on symbols; the recogniser needs both (Q's
length is K's, a mask's last dim is ``past + seq``). Here shape data is carried as arrays of
sympy expressions, so ``Reshape(x, Concat(Gather(Shape(x), 0), [-1], ...))`` gives named dims.

How a node is read, in order: a node whose inputs are all known small integers is evaluated
(ONNX's reference evaluator); an operator of ``symbolic_ops.OPS`` is read there (shape data,
broadcasting, reshapes, convolutions' lengths); any other operator goes through ONNX's own
per-node inference (its public ``infer_node_outputs``), with symbolic dims written as text.
``If`` branches are read in place with the outer graph's facts. A node nothing can read
leaves its outputs unknown and the values after it take what can still be read.

Broadcasting two different symbols means they are equal where the graph runs: the derived one
is replaced by the other everywhere (an input's symbol is never replaced), as ORT's
``auto_merge`` does.
"""

from mha_onnx.graph.symbolic.engine import infer_shapes

__all__ = ["infer_shapes"]
