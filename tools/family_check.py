"""Families newer than the test library, through `mha-onnx export --model` as a user runs it:
each a tiny random-weight `save_pretrained` folder (nothing downloaded), exported in float32
and float16 (torch.export, fused, validated against PyTorch), one row per run with the exit
code and what fuse made of the blocks, or the one-line reason it stopped. With ``--tokens N``
a decoder's file then generates N greedy tokens (mha_onnx.generate, no EOS stop) for a batch
of three prompts of different lengths (optimum_fixtures.PROMPTS), compared with
transformers' greedy generate of the float32 model on the same prompts, left-padded into
one batch. With ``--genai N`` (and ``--kv-cache shared``) ONNX Runtime GenAI's generator
(`make genai-env`) runs the folder export wrote on the same prompts as one right-padded
batch, N tokens, through the file genai_config.json names and through the file as written:
which file that is, and whether the two give the same tokens (generate/genai_file.py); a
family whose EOS lies outside the tiny vocabulary gets the last id as its EOS first.

    .venv/bin/python -m tools.family_check OUT_DIR [--only a,b] [--dtypes float32,float16]
        [--kv-cache appended|shared] [--tokens 16] [--genai 24]

Writes OUT_DIR/families.md (and a folder and a log per family); exit 0 whatever the rows say
(it is a survey: read the table).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TEXT = dict(vocab_size=99, max_position_embeddings=128, **SMALL)
GROUPED = dict(num_key_value_heads=2, **TEXT)
WIDE = dict(initializer_range=0.2, **GROUPED)
TEXT_WIDE = dict(initializer_range=0.2, **TEXT)
AUDIO = dict(conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, **SMALL)
SEQ2SEQ = dict(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64,
               decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
               max_position_embeddings=128)


def families() -> dict[str, Callable]:
    """family -> a function making its model (transformers imported here, not at start)."""
    import transformers as tf

    def model(name: str, config: str, **fields) -> Callable:
        return lambda: getattr(tf, name)(getattr(tf, config)(**fields))

    return {
        "olmo3": model("Olmo3ForCausalLM", "Olmo3Config", **GROUPED),
        "arcee": model("ArceeForCausalLM", "ArceeConfig", **GROUPED),
        "seed_oss": model("SeedOssForCausalLM", "SeedOssConfig", head_dim=8, **GROUPED),
        "glm4": model("Glm4ForCausalLM", "Glm4Config", head_dim=8, pad_token_id=0, **GROUPED),
        "cohere2": model("Cohere2ForCausalLM", "Cohere2Config", sliding_window=64, **GROUPED),
        "ministral": model("MinistralForCausalLM", "MinistralConfig", head_dim=8,
                           sliding_window=64, **GROUPED),
        "ernie4_5": model("Ernie4_5ForCausalLM", "Ernie4_5Config", head_dim=8, **GROUPED),
        "hunyuan_dense": model("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", head_dim=8,
                               **GROUPED),
        "apertus": model("ApertusForCausalLM", "ApertusConfig", **GROUPED),
        "bitnet": model("BitNetForCausalLM", "BitNetConfig", **GROUPED),
        "helium": model("HeliumForCausalLM", "HeliumConfig", head_dim=8, **GROUPED),
        # decoders first tried 2026-12-04 (with --tokens); logits far apart (initializer
        # range 0.2) so that tokens are decided by the model, not by float noise at a near-tie
        "starcoder2": model("Starcoder2ForCausalLM", "Starcoder2Config", sliding_window=64,
                            **WIDE),
        "exaone4": model("Exaone4ForCausalLM", "Exaone4Config", sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"], **WIDE),
        "vaultgemma": model("VaultGemmaForCausalLM", "VaultGemmaConfig", head_dim=8, **WIDE),
        # a cap that binds on these scores (Gemma 2's own 50 never does on random weights)
        "gemma2": model("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, sliding_window=8,
                        attn_logit_softcapping=5.0, **WIDE),
        "persimmon": model("PersimmonForCausalLM", "PersimmonConfig", **TEXT_WIDE),
        "biogpt": model("BioGptForCausalLM", "BioGptConfig", **TEXT_WIDE),
        "xglm": model("XGLMForCausalLM", "XGLMConfig", vocab_size=99, d_model=32, num_layers=2,
                      attention_heads=4, ffn_dim=64, max_position_embeddings=128,
                      init_std=0.2),
        "nanochat": model("NanoChatForCausalLM", "NanoChatConfig", **WIDE),
        "mixtral": model("MixtralForCausalLM", "MixtralConfig", num_local_experts=4,
                         num_experts_per_tok=2, **WIDE),
        "olmoe": model("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2,
                       **WIDE),
        "qwen2_moe": model("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, **WIDE),
        "granitemoe": model("GraniteMoeForCausalLM", "GraniteMoeConfig", num_local_experts=4,
                            num_experts_per_tok=2, **WIDE),
        # more routed experts (issue 42, class 1, session 28: routes held in the checks)
        "qwen3_moe": model("Qwen3MoeForCausalLM", "Qwen3MoeConfig", num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, **WIDE),
        "ernie4_5_moe": model("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", head_dim=8,
                              moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                              moe_layer_start_index=0, **WIDE),
        "glm4_moe": model("Glm4MoeForCausalLM", "Glm4MoeConfig", head_dim=8, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
                          topk_group=1, first_k_dense_replace=0, **WIDE),
        "phimoe": model("PhimoeForCausalLM", "PhimoeConfig", num_local_experts=4,
                        num_experts_per_tok=2, **WIDE),
        "flex_olmo": model("FlexOlmoForCausalLM", "FlexOlmoConfig", num_experts=4,
                           num_experts_per_tok=2, pad_token_id=0, eos_token_id=2, **WIDE),
        "jetmoe": model("JetMoeForCausalLM", "JetMoeConfig", vocab_size=99, hidden_size=32,
                        num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=128, initializer_range=0.2),
        "albert": model("AlbertModel", "AlbertConfig", embedding_size=32, **TEXT),
        "distilbert": model("DistilBertModel", "DistilBertConfig", vocab_size=99, dim=32,
                            n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128),
        "electra": model("ElectraModel", "ElectraConfig", embedding_size=32, **TEXT),
        "eurobert": model("EuroBertModel", "EuroBertConfig", pad_token_id=0, mask_token_id=1,
                          bos_token_id=2, eos_token_id=3, **GROUPED),
        "dinov2": model("Dinov2Model", "Dinov2Config", image_size=32, patch_size=8, **SMALL),
        "deit": model("DeiTModel", "DeiTConfig", image_size=32, patch_size=8, **SMALL),
        "siglip_vision": model("SiglipVisionModel", "SiglipVisionConfig", image_size=32,
                               patch_size=8, **SMALL),
        "wav2vec2": model("Wav2Vec2Model", "Wav2Vec2Config", **AUDIO),
        "hubert": model("HubertModel", "HubertConfig", **AUDIO),
        "marian": model("MarianMTModel", "MarianConfig", pad_token_id=0,
                        decoder_start_token_id=0, **SEQ2SEQ),
        "pegasus": model("PegasusForConditionalGeneration", "PegasusConfig", **SEQ2SEQ),
        # local attention written with Einsums over blocks (rewrite/prepare/einsums.py)
        "longt5": model("LongT5ForConditionalGeneration", "LongT5Config", vocab_size=99,
                        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1,
                        num_heads=4, encoder_attention_type="local", local_radius=8,
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
        "pegasus_x": model("PegasusXForConditionalGeneration", "PegasusXConfig",
                           num_global_tokens=4, block_size=8, stagger_local_blocks=True,
                           pad_token_id=0, decoder_start_token_id=0, eos_token_id=1,
                           **SEQ2SEQ),
    }


def _row(name: str, dtype: str, folder: Path, out: Path, args: argparse.Namespace,
         decoder: bool) -> str:
    log, path = out / f"{name}.{dtype}.log", out / f"{name}.{dtype}" / "model.onnx"
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "mha_onnx.cli", "export", "--model", str(folder),
                          "-o", str(path), "--dtype", dtype, "--force",
                          "--kv-cache", args.kv_cache], capture_output=True, text=True)
    log.write_text(run.stdout + run.stderr)
    lines = (run.stdout + run.stderr).splitlines()
    said = [line.strip() for line in lines if line.lstrip().startswith(("fused:", "validated",
                                                                          "error:"))]
    text = " / ".join(said).replace("|", "\\|")[:400]
    if args.tokens and run.returncode == 0 and decoder:
        text += f" / tokens: {_tokens(folder, path, args.tokens)}"
    if args.genai and run.returncode == 0 and decoder:
        text += f" / GenAI: {_genai(path, args.genai)}"
    return f"| {name} | {dtype} | {run.returncode} | {time.perf_counter() - started:.0f} s | {text} |"


def _tokens(folder: Path, path: Path, new: int) -> str:
    """Our greedy tokens for optimum_fixtures.PROMPTS (one batch) against transformers'
    (float32, the batch left-padded: optimum_fixtures.greedy), neither stopping at an EOS:
    'equal' or where they first differ."""
    import torch
    import transformers as tf

    from mha_onnx.generate import GenerationConfig, Generator
    from tools.optimum_fixtures import PROMPTS, greedy

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = greedy(model, new, stop_at_eos=False)["batch3"]
    with Generator(path) as generator:
        got = [list(s) for s in generator.generate(PROMPTS, GenerationConfig(new, eos=())).sequences]
    for row, (a, b) in enumerate(zip(got, want, strict=True)):
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if at is not None:
            return f"row {row} differs at token {at} of {new}"
    return f"{new} x {len(PROMPTS)} equal"


def _eos_inside(model) -> None:
    """GenAI needs an eos_token_id inside the vocabulary: the tiny configs' defaults often
    lie past their 99 ids (a token id only; no run here stops at an EOS)."""
    vocab = model.config.get_text_config().vocab_size
    eos = model.generation_config.eos_token_id
    if not isinstance(eos, int) or not 0 <= eos < vocab:
        model.config.eos_token_id = model.generation_config.eos_token_id = vocab - 1


def _genai(path: Path, new: int) -> str:
    """GenAI's right-padded batch through the file genai_config.json names and through the
    file as written (a copy of the folder's config naming it)."""
    import json
    import shutil

    from tools.optimum_fixtures import PROMPTS

    config_path = path.with_name("genai_config.json")
    if not config_path.is_file():
        return "no genai_config.json"
    config = json.loads(config_path.read_text())
    runs = config["model"]["decoder"]["filename"]
    prompts = path.with_name("genai_prompts.json")
    prompts.write_text(json.dumps(PROMPTS))
    as_written = path.parent.with_name(path.parent.name + ".as-written")
    shutil.rmtree(as_written, ignore_errors=True)
    as_written.mkdir()
    for item in path.parent.iterdir():
        if item.name != "genai_config.json":
            (as_written / item.name).symlink_to(item.resolve())
    config["model"]["decoder"]["filename"] = path.name
    (as_written / "genai_config.json").write_text(json.dumps(config))
    python = Path(__file__).resolve().parents[1] / ".venv-genai-rt" / "bin" / "python"
    got = []
    for folder in (path.parent, as_written):
        done = subprocess.run([str(python), str(Path(__file__).with_name("genai_generate.py")),
                               str(folder), "--prompts", str(prompts), "--max-new-tokens",
                               str(new), "--mode", "batch"], capture_output=True, text=True)
        if done.returncode:
            said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            return f"{runs}: GenAI failed: {said[:150]}"
        got.append(json.loads(done.stdout.strip().splitlines()[-1])["sequences"])
    if runs == path.name:
        return f"runs {runs}"
    return f"runs {runs}, " + ("the same tokens as the file as written" if got[0] == got[1]
                               else "tokens differ from the file as written")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default="")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--kv-cache", default="appended", choices=("appended", "shared"))
    parser.add_argument("--tokens", type=int, default=0, help="greedy tokens to compare")
    parser.add_argument("--genai", type=int, default=0,
                        help="GenAI's tokens to compare (the file it runs, as written)")
    args = parser.parse_args()
    import torch

    made = families()
    names = [n for n in args.only.split(",") if n] or list(made)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = ["| family | dtype | exit | time | what export --model said |", "|---|---|---|---|---|"]
    for name in names:
        folder = args.out / name
        torch.manual_seed(0)
        model = made[name]()
        decoder = type(model).__name__.endswith("ForCausalLM")
        if args.genai and decoder:
            _eos_inside(model)
        model.save_pretrained(folder)
        for dtype in args.dtypes.split(","):
            rows.append(_row(name, dtype, folder, args.out, args, decoder))
            print(rows[-1], flush=True)
    command = "python -m tools.family_check " + " ".join(sys.argv[1:])
    (args.out / "families.md").write_text(f"`{command}`\n\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
