"""PyTorch to ONNX: the own multi-head attention (mha.py) and Hugging Face folders (hf.py);
the PyTorch modules they export and check against are in mha_onnx.reference.
"""
