"""``mha-onnx package``: a Triton Inference Server model repository for a checked model
(repository.py; its config text in pbtxt.py, its README in readme.py; decoders with a KV
cache served statefully, decoder.py)."""
