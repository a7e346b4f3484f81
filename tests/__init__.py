"""The test suite; its folders mirror the packages of mha_onnx/ (tools/: the benchmarks)."""
