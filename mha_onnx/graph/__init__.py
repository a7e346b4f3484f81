"""Graph basics every stage reads: ONNX files (files.py), inputs and what each is
(inputs.py, roles.py, dims.py), what mha-onnx records in a model (metadata.py, original.py)
and a model's KV-cache interface (cache.py)."""
