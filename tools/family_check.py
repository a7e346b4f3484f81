"""Families newer than the test library, through `mha-onnx export --model` as a user runs it:
each a tiny random-weight `save_pretrained` folder (nothing downloaded), exported in float32
and float16 (torch.export, fused, validated against PyTorch), one row per run with the exit
code and what fuse made of the blocks, or the one-line reason it stopped.

    .venv/bin/python -m tools.family_check OUT_DIR [--only a,b] [--dtypes float32,float16]

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
    }


def _row(name: str, dtype: str, folder: Path, out: Path) -> str:
    log = out / f"{name}.{dtype}.log"
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "mha_onnx.cli", "export", "--model", str(folder),
                          "-o", str(out / f"{name}.{dtype}.onnx"), "--dtype", dtype, "--force"],
                         capture_output=True, text=True)
    log.write_text(run.stdout + run.stderr)
    lines = (run.stdout + run.stderr).splitlines()
    said = [line.strip() for line in lines if line.lstrip().startswith(("fused:", "validated",
                                                                          "error:"))]
    text = " / ".join(said).replace("|", "\\|")
    return (f"| {name} | {dtype} | {run.returncode} | {time.perf_counter() - started:.0f} s "
            f"| {text[:400]} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default="")
    parser.add_argument("--dtypes", default="float32,float16")
    args = parser.parse_args()
    import torch

    made = families()
    names = [n for n in args.only.split(",") if n] or list(made)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = ["| family | dtype | exit | time | what export --model said |", "|---|---|---|---|---|"]
    for name in names:
        folder = args.out / name
        torch.manual_seed(0)
        made[name]().save_pretrained(folder)
        for dtype in args.dtypes.split(","):
            rows.append(_row(name, dtype, folder, args.out))
            print(rows[-1], flush=True)
    command = "python -m tools.family_check " + " ".join(sys.argv[1:])
    (args.out / "families.md").write_text(f"`{command}`\n\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
