"""Stage 2: each internal Sdpa node onto a kernel, one module per kernel family.

``common`` (tape ops, If branches, cloning, mask operands shared by the forms), ``ort``
(the ONNX Runtime target: which form per mask kind, the rules, MultiHeadAttention forms),
``gqa`` (GroupQueryAttention), ``cached`` (a KV cache appended to), ``shared`` (one
max-length buffer as past and present) with ``rows`` (per-row lengths), ``loop`` (key
padding as a Loop over the batch), ``attention`` (the standard ONNX Attention op).
"""
