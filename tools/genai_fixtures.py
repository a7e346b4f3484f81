"""Graphs written by ORT GenAI's model builder for a small random-weight Llama: decoder files
users have that nobody here wrote (`profile`, `validate` and `inspect` must take them).

    make genai-fixtures    # makes .venv-genai (the builder: onnxruntime-genai 0.18.0,
                           # transformers 5, torch), then runs
    .venv-genai/bin/python tools/genai_fixtures.py --out tests/fixtures/genai

The model: Llama, hidden 64, 4 query / 2 K/V heads, 2 layers, a vocabulary of 128 (a BPE
trained on a few words: the builder needs a tokenizer), random weights (seed 0), built from
a config and saved with `save_pretrained` (nothing downloaded). The builder runs twice,
`-p fp32 -e cpu` and `-p int4 -e cpu` (MatMulNBits, its CPU default); each folder keeps
the graph, its weights file, `genai_config.json` and `versions.json` with what made them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

CONFIG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}
KEPT = ("model.onnx", "model.onnx.data", "genai_config.json")


def hf_folder(folder: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).eval().save_pretrained(folder)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["multi-head attention under ONNX Runtime"] * 20,
                            trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"],
                                                special_tokens=["<unk>", "<s>", "</s>"]))
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>").save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/genai"))
    args = parser.parse_args(argv)
    versions = {name: metadata.version(name) for name in
                ("onnxruntime-genai", "onnxruntime", "transformers", "torch", "onnx")}
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf_folder(hf)
        for precision in ("fp32", "int4"):
            built = Path(tmp) / precision
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                            str(hf), "-o", str(built), "-p", precision, "-e", "cpu"],
                           check=True, capture_output=True)
            out = args.out / f"llama-{precision}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            files = [name for name in KEPT if (built / name).exists()]
            for name in files:
                shutil.copy(built / name, out / name)
            (out / "versions.json").write_text(json.dumps(
                {"made_by": "tools/genai_fixtures.py",
                 "builder": f"-p {precision} -e cpu", "config": CONFIG, "files": files,
                 "versions": versions}, indent=1) + "\n")
            print(f"{out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
