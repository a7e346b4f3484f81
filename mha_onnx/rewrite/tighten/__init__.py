"""After lowering, the ONNX Runtime target's layer around the kernels (passes ``FuseNorms``,
``ResidualSums``, ``FoldRotary``, ``Guards``, ``PackKernelInputs``, ``FitToOpset``):
``norms`` (RMS norms onto ORT's kernels, residual Sums), ``rotary_fold`` (the exporter's
rotary folded into GQA) with ``rotary_match`` (recognising that rotation), ``packing``
(Q/K/V projections in one MatMul), ``tidy`` (one guard computation per model) and
``into_branches`` (work only an If's branches read moved into them), ``opset_fit`` (the
forms spelt as the model's opset allows)."""
