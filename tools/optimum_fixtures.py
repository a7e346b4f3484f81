"""Optimum exports of small random-weight models: the files users actually have.

    make fixtures          # makes .venv-optimum (optimum-onnx 0.1.0, transformers < 4.58)
                           # and runs this script in it
    .venv-optimum/bin/python tools/optimum_fixtures.py [--out tests/fixtures/optimum]
        [--only llama,gpt2,...]

optimum-onnx 0.1.0 (the newest release) needs transformers < 4.58 while this project pins
transformers 5, so the exports are made in a second environment and committed (CONTRIBUTING.md,
rule 15): one folder per family holding the ONNX file(s) Optimum wrote (TorchScript exporter, opset
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
SWIN = {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [2, 2],
        "num_heads": [2, 4], "num_attention_heads": [2, 4], "window_size": 4}
AUDIO = {"vocab_size": 32, "conv_dim": [16, 16], "conv_stride": [5, 2], "conv_kernel": [10, 3],
         "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4}
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
    # sliding-window layers (window 16: generation runs past it)
    "gemma3": ("text-generation-with-past", "Gemma3TextConfig", "Gemma3ForCausalLM",
               {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16}),
    "gpt2": ("text-generation-with-past", "GPT2Config", "GPT2LMHeadModel",
             {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "gpt_neox": ("text-generation-with-past", "GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    # the rotation on [B, S, heads, D] before the heads' transpose, interleaved, partial;
    # cos/sin looked up in a table of n_positions rows (head 32: the kernel rotates 16 of it)
    "gptj": ("text-generation-with-past", "GPTJConfig", "GPTJForCausalLM",
             {"num_attention_heads": 2, "rotary_dim": 16, "n_inner": 128}),
    # causal scores replaced by the fill (a local window every other layer), then the 4-D
    # mask added: a key both hide gets -inf, a padded one the fill (two mask terms)
    "gpt_neo": ("text-generation-with-past", "GPTNeoConfig", "GPTNeoForCausalLM",
                {"num_layers": 2, "num_heads": 4, "attention_types": [[["global", "local"], 1]],
                 "window_size": 16}),
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
    # mixtures of experts: the router's top-k, each expert's tokens gathered, scattered back
    "qwen3_moe": ("text-generation-with-past", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "decoder_sparse_step": 1}),
    # MLA (a low-rank K/V, the rotary on a slice of each head, V narrower than Q/K) + MoE
    "deepseek_v3": ("text-generation-with-past", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1, "topk_group": 1}),
    # attention sinks (a learned logit per head beside the scores), sliding-window layers
    # every other one, MoE
    "gpt_oss": ("text-generation-with-past", "GptOssConfig", "GptOssForCausalLM",
                {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "sliding_window": 16, "intermediate_size": 64,
                 "layer_types": ["sliding_attention", "full_attention"]}),
    # speech encoders with a convolutional front end: Moonshine's mask cut to the conv
    # stack's length by a Slice whose end ORT's shape inference cannot compare; Speech2Text's
    # mask subsampled with its features; Whisper's merged decoder gathers positions from a
    # 64-row table inside its If branches
    "moonshine": ("automatic-speech-recognition-with-past", "MoonshineConfig",
                  "MoonshineForConditionalGeneration",
                  {"encoder_num_hidden_layers": 2, "decoder_num_hidden_layers": 2,
                   "encoder_num_attention_heads": 4, "decoder_num_attention_heads": 4}),
    "speech_to_text": ("automatic-speech-recognition-with-past", "Speech2TextConfig",
                       "Speech2TextForConditionalGeneration",
                       {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                        "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                        "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
                        "max_source_positions": 256, "max_target_positions": 128,
                        "conv_channels": 32, "input_feat_per_channel": 16}),
    "whisper": ("automatic-speech-recognition-with-past", "WhisperConfig",
                "WhisperForConditionalGeneration",
                {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                 "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                 "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 16,
                 "max_source_positions": 1500, "max_target_positions": 64, "pad_token_id": 1,
                 "bos_token_id": 2, "eos_token_id": 3, "decoder_start_token_id": 2,
                 "begin_suppress_tokens": None, "suppress_tokens": None}),
    # shifted windows: the windows' mask added on a [B, nW, heads, N, N] view of the scores
    "swin": ("image-feature-extraction", "SwinConfig", "SwinModel", SWIN),
    "donut_swin": ("image-feature-extraction", "DonutSwinConfig", "DonutSwinModel", SWIN),
    # cosine attention (Q, K L2-normalised), a learned scale per head, the mask added twice
    "swinv2": ("image-feature-extraction", "Swinv2Config", "Swinv2Model", SWIN),
    # audio encoders: conv feature extractor on raw samples; WavLM's gated relative position
    # bias; SEW's squeezed sequence (a Slice end ORT's shape inference asserted on)
    "wav2vec2": ("feature-extraction", "Wav2Vec2Config", "Wav2Vec2Model", AUDIO),
    "wavlm": ("feature-extraction", "WavLMConfig", "WavLMModel",
              {**AUDIO, "num_buckets": 32, "max_bucket_distance": 64}),
    "sew": ("feature-extraction", "SEWConfig", "SEWModel", {**AUDIO, "squeeze_factor": 2}),
    # attention pooling: SigLIP's head (a learned query of batch 1 over the batch's tokens,
    # nn.MultiheadAttention's packed in-projection sliced at Mod(-1, 3)); DETR's object
    # queries, its pixel mask added on a [B, H, T, S] view of [B*H, T, S] scores
    "siglip_vision": ("feature-extraction", "SiglipVisionConfig", "SiglipVisionModel",
                      {"image_size": 32, "patch_size": 8, "vision_use_head": True}),
    "detr": ("object-detection", "DetrConfig", "DetrForObjectDetection",
             {"backbone_config": {"model_type": "resnet", "embedding_size": 16,
                                  "hidden_sizes": [16, 32], "depths": [1, 1],
                                  "out_features": ["stage2"]},
              "use_timm_backbone": False, "use_pretrained_backbone": False, "d_model": 64,
              "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
              "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
              "num_queries": 8, "num_labels": 3}),
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
    # local attention over blocks of 9 (radius 8): Q [B, blocks, 9, H, D] against each
    # block's 27 neighbouring keys, both products 5-D Einsums (its encoder only)
    "longt5": ("text2text-generation", "LongT5Config", "LongT5ForConditionalGeneration",
               {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
                "num_decoder_layers": 2, "num_heads": 4, "encoder_attention_type": "local",
                "local_radius": 8, "decoder_start_token_id": 0}),
}

# families whose folders keep only some of Optimum's files (the rest is what other fixtures
# cover already); config.json kept where it is listed (fuse reads a folder's HF config)
KEEP = {
    "moonshine": ("encoder_model.onnx", "decoder_with_past_model.onnx", "config.json"),
    "speech_to_text": ("encoder_model.onnx",),
    "longt5": ("encoder_model.onnx",),
    "whisper": ("decoder_model_merged.onnx", "config.json"),
}


# Decoders: greedy tokens of transformers.generate on these prompts (left-padded as a batch)
# are recorded beside the export (generate.json), so that `mha-onnx generate` of the fused
# export is checked against transformers without this environment.
PROMPTS = [[20, 31, 5, 77, 12], [40, 3, 9, 91, 18, 60, 22, 7, 50], [66, 13, 84]]
NEW_TOKENS = 32


def optimum_export(task: str, config_name: str, model_name: str, fields: dict,
                   output: Path) -> dict | None:
    """The transformers model ``model_name(config_name(**fields))`` with random weights
    (seed 0), saved with save_pretrained and exported from that folder by Optimum into
    ``output``, as a user exports a folder (.venv-optimum). Decoders: their greedy tokens
    (:func:`greedy`)."""
    import torch
    import transformers as tf
    from optimum.exporters.onnx import main_export

    torch.manual_seed(0)
    model = getattr(tf, model_name)(getattr(tf, config_name)(**fields)).eval()
    with tempfile.TemporaryDirectory(prefix=f"optimum_{model_name}_") as tmp:
        model.save_pretrained(Path(tmp) / "model")
        main_export(str(Path(tmp) / "model"), output=str(output), task=task,
                    do_validation=False)
    return greedy(model) if task == "text-generation-with-past" else None


def greedy(model, new: int = NEW_TOKENS, stop_at_eos: bool = True) -> dict:
    """transformers.generate's greedy tokens for PROMPTS: the first alone and all three
    left-padded in one batch; each row's ``new`` tokens, up to and including an EOS
    (``stop_at_eos``; else all of them, an EOS generated like any token)."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None
           and e < model.config.vocab_size] if stop_at_eos else []

    def run(prompts):
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=new, pad_token_id=0, eos_token_id=eos or None)
        rows = []
        for row in out[:, longest:].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos), None)
            rows.append(row[:cut + 1] if cut is not None else row)
        return rows

    saved = model.generation_config.eos_token_id
    if not stop_at_eos:  # (an eos_token_id of None given to generate falls back to this)
        model.generation_config.eos_token_id = None
    try:
        return {"prompts": PROMPTS, "max_new_tokens": new, "eos_token_id": eos,
                "batch1": run(PROMPTS[:1]), "batch3": run(PROMPTS)}
    finally:
        model.generation_config.eos_token_id = saved


def export(family: str, out: Path) -> list[str]:
    task, config_name, model_name, extra = FAMILIES[family]
    with tempfile.TemporaryDirectory(prefix=f"optimum_{family}_") as tmp:
        tokens = optimum_export(task, config_name, model_name, {**COMMON, **extra},
                                Path(tmp) / "onnx")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for onnx_file in sorted((Path(tmp) / "onnx").glob("*.onnx")):
            if family in KEEP and onnx_file.name not in KEEP[family]:
                continue
            if onnx_file.stat().st_size > 1_500_000:
                raise SystemExit(f"{family}: {onnx_file.name} is over 1.5 MB")
            shutil.copy(onnx_file, out / onnx_file.name)
            written.append(onnx_file.name)
        if "config.json" in KEEP.get(family, ()):
            shutil.copy(Path(tmp) / "onnx" / "config.json", out / "config.json")
            written.append("config.json")
        if tokens is not None:  # a decoder: the folder as Optimum writes it, and its tokens
            for name in ("config.json", "generation_config.json"):
                shutil.copy(Path(tmp) / "onnx" / name, out / name)
                written.append(name)
            (out / "generate.json").write_text(json.dumps(tokens) + "\n")
            written.append("generate.json")
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
