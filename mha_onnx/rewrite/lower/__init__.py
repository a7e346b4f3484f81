"""Stage 2: each internal Sdpa node onto a kernel, one module per kernel family.

``rules`` (the ONNX Runtime target's rewrite rules: which values each replaces, presents
included), ``ort`` (which form per mask kind, MultiHeadAttention forms), ``lowered`` (an
appended KV cache as a rule reads it, and what a lowering returns), ``common`` (tape ops,
If branches, cloning, mask operands shared by the forms), ``gqa`` (GroupQueryAttention),
``cached`` (a KV cache appended to), ``shared`` (one max-length buffer as past and present)
with ``rows`` (per-row lengths), ``loop`` (key padding as a Loop over the batch),
``attention`` (the standard ONNX Attention op).
"""
