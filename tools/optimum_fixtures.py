"""Optimum exports of small random-weight models: the files users actually have.

    make fixtures          # makes .venv-optimum (optimum-onnx 0.1.0, transformers < 4.58)
                           # and runs this script in it
    .venv-optimum/bin/python tools/optimum_fixtures.py [--out tests/fixtures/optimum]
        [--only llama,gpt2,...]

optimum-onnx 0.1.0 (the newest release) needs transformers < 4.58 while this project pins
transformers 5, so the exports are made in a second environment and committed (STYLE.md rule
14): one folder per family holding the ONNX file(s) Optimum wrote (TorchScript exporter, opset
18, no value_info) and `versions.json` with what made them. Weights are random (seed 0),
hidden size <= 64, so each file stays far below 1 MB. Nothing is downloaded: each model is
built from a config, saved with `save_pretrained` and exported from that folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

# family -> (task, config class, model class, config fields)
COMMON = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "max_position_embeddings": 256}
FAMILIES: dict[str, tuple[str, str, str, dict]] = {
    "llama": ("text-generation-with-past", "LlamaConfig", "LlamaForCausalLM",
              {"num_key_value_heads": 2}),
    "qwen2": ("text-generation-with-past", "Qwen2Config", "Qwen2ForCausalLM",
              {"num_key_value_heads": 2}),
    "mistral": ("text-generation-with-past", "MistralConfig", "MistralForCausalLM",
                {"num_key_value_heads": 2, "sliding_window": None}),
    "phi3": ("text-generation-with-past", "Phi3Config", "Phi3ForCausalLM",
             {"num_key_value_heads": 2, "pad_token_id": 0}),
    "gemma": ("text-generation-with-past", "GemmaConfig", "GemmaForCausalLM",
              {"num_key_value_heads": 1, "head_dim": 16}),
    "qwen3": ("text-generation-with-past", "Qwen3Config", "Qwen3ForCausalLM",
              {"num_key_value_heads": 2, "head_dim": 16}),
    "gpt2": ("text-generation-with-past", "GPT2Config", "GPT2LMHeadModel",
             {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "gpt_neox": ("text-generation-with-past", "GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    # the rotation on [B, S, heads, D] before the heads' transpose, interleaved, partial;
    # cos/sin looked up in a table of n_positions rows (head 32: the kernel rotates 16 of it)
    "gptj": ("text-generation-with-past", "GPTJConfig", "GPTJForCausalLM",
             {"num_attention_heads": 2, "rotary_dim": 16, "n_inner": 128}),
    "bloom": ("text-generation-with-past", "BloomConfig", "BloomForCausalLM",
              {"n_layer": 2, "n_head": 4}),
    "opt": ("text-generation-with-past", "OPTConfig", "OPTForCausalLM",
            {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "falcon": ("text-generation-with-past", "FalconConfig", "FalconForCausalLM",
               {"new_decoder_architecture": False, "multi_query": True, "alibi": False}),
    # interleaved, partial rotary whose repeat_interleave sizes an Expand by a ReduceMax
    "glm": ("text-generation-with-past", "GlmConfig", "GlmForCausalLM",
            {"num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0}),
    # ALiBi table sliced to the keys, added before the TorchScript 4-D mask
    "mpt": ("text-generation-with-past", "MptConfig", "MptForCausalLM",
            {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 256,
             "expansion_ratio": 2}),
    "bert": ("feature-extraction", "BertConfig", "BertModel", {}),
    # probabilities viewed by their own sizes; c2p/p2c relative attention (a dense bias)
    "deberta_v2": ("feature-extraction", "DebertaV2Config", "DebertaV2Model",
                   {"relative_attention": True, "pos_att_type": ["p2c", "c2p"],
                    "position_buckets": 32, "max_relative_positions": -1,
                    "share_att_key": True, "norm_rel_ebd": "layer_norm"}),
    "roberta": ("feature-extraction", "RobertaConfig", "RobertaModel", {"pad_token_id": 1}),
    "distilbert": ("feature-extraction", "DistilBertConfig", "DistilBertModel",
                   {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128}),
    "electra": ("feature-extraction", "ElectraConfig", "ElectraModel", {"embedding_size": 64}),
    "vit": ("image-feature-extraction", "ViTConfig", "ViTModel",
            {"image_size": 32, "patch_size": 8}),
    # BART's decoder_with_past was refused by ORT after fusing (hoisted names repeated)
    "bart": ("text2text-generation-with-past", "BartConfig", "BartForConditionalGeneration",
             {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
              "encoder_attention_heads": 4, "decoder_attention_heads": 4,
              "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "pad_token_id": 1,
              "decoder_start_token_id": 2}),
    "t5": ("text2text-generation-with-past", "T5Config", "T5ForConditionalGeneration",
           {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2,
            "num_heads": 4}),
}


def optimum_export(task: str, config_name: str, model_name: str, fields: dict,
                   output: Path) -> None:
    """The transformers model ``model_name(config_name(**fields))`` with random weights
    (seed 0), saved with save_pretrained and exported from that folder by Optimum into
    ``output``, as a user exports a folder (.venv-optimum)."""
    import torch
    import transformers as tf
    from optimum.exporters.onnx import main_export

    torch.manual_seed(0)
    model = getattr(tf, model_name)(getattr(tf, config_name)(**fields)).eval()
    with tempfile.TemporaryDirectory(prefix=f"optimum_{model_name}_") as tmp:
        model.save_pretrained(Path(tmp) / "model")
        main_export(str(Path(tmp) / "model"), output=str(output), task=task,
                    do_validation=False)


def export(family: str, out: Path) -> list[str]:
    task, config_name, model_name, extra = FAMILIES[family]
    with tempfile.TemporaryDirectory(prefix=f"optimum_{family}_") as tmp:
        optimum_export(task, config_name, model_name, {**COMMON, **extra}, Path(tmp) / "onnx")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for onnx_file in sorted((Path(tmp) / "onnx").glob("*.onnx")):
            if onnx_file.stat().st_size > 1_500_000:
                raise SystemExit(f"{family}: {onnx_file.name} is over 1.5 MB")
            shutil.copy(onnx_file, out / onnx_file.name)
            written.append(onnx_file.name)
    return written


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {name: md.version(name) for name in
            ("optimum-onnx", "optimum", "transformers", "torch", "onnx")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/optimum")
    parser.add_argument("--only", default=None)
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else list(FAMILIES)
    made = versions()
    for family in only:
        files = export(family, Path(args.out) / family)
        task = FAMILIES[family][0]
        (Path(args.out) / family / "versions.json").write_text(json.dumps(
            {"task": task, "files": files, "config": {**COMMON, **FAMILIES[family][3]},
             "made_by": "tools/optimum_fixtures.py", "versions": made}, indent=1) + "\n")
        print(family, task, files, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
