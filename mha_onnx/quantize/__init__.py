"""Weights in 4 or 8 bits (``mha-onnx quantize``), with an accuracy report against the float
model: weights.py (ONNX Runtime's quantizer over every graph), accuracy.py (the report)."""
