"""PyTorch to ONNX: the own multi-head attention (mha.py, with its PyTorch reference in
reference.py and weight import in weights.py) and Hugging Face folders (hf.py, hf_model.py).
"""
