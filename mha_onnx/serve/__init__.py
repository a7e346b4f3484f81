"""Serving: ``package`` writes a Triton Inference Server model repository (package.py; its
config text in pbtxt.py, its README in readme.py; decoders with a KV cache served
statefully, decoder.py)."""
