"""Before recognition (passes ``Prepare`` and ``Normalise``): shape facts for graphs that carry
none (``shapes``), repairs ONNX Runtime needs (``repairs``), one attention per Softmax
(``shared_probs``), a mask added on a view of the scores made a bias on them (``windows``),
Einsum attention over blocks as 4-D MatMuls (``einsums``). The clean-up every export runs
too, ``rewrite/faithful.py``, stays beside the passes (the exporters import it)."""
