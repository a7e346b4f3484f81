"""Tokens from a decoder under ONNX Runtime: ``mha-onnx generate`` and its library.

    from mha_onnx.generate import Generator, GenerationConfig
    with Generator("model.onnx") as generator:
        result = generator.generate([[1, 2, 3], [4, 5]], GenerationConfig(max_new_tokens=32))
    result.sequences  # the new ids of each row

The generation contract (what each run is fed) is in :mod:`mha_onnx.graph.decoder`
and the README; :mod:`mha_onnx.generate.loop` runs it.
"""

from mha_onnx.generate.loop import GenerationConfig, GenerationResult, Generator, prompt_feeds
from mha_onnx.generate.sampling import Sampling
from mha_onnx.graph.decoder import DecoderInterface, TokenIds, read_interface

__all__ = ["DecoderInterface", "GenerationConfig", "GenerationResult", "Generator", "Sampling",
           "TokenIds", "prompt_feeds", "read_interface"]
