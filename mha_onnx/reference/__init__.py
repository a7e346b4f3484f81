"""The PyTorch side of every check: the project's multi-head attention (mha.py, the seed's
equations), its weights read from safetensors or state dicts (weights.py), and Hugging Face
folders loaded as the references of their exports (hf.py). Export, validate and quantize
read them; nothing here imports the stages above it."""
