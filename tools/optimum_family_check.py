"""Families the committed Optimum fixtures do not hold, exported by Optimum as a user would and
given to `mha-onnx fuse`: the held-out check of issue 20 (the files users have).

    make bench-envs        # .venv-optimum: optimum-onnx 0.1.0, transformers < 4.58
    .venv-optimum/bin/python -m tools.optimum_family_check make OUT [--only a,b]
    .venv/bin/python -m tools.optimum_family_check run OUT [--only a,b]

``make`` builds each family from a config (tiny, random weights, seed 0; nothing downloaded),
saves it with ``save_pretrained`` and exports that folder with Optimum's ``main_export``
(TorchScript exporter, opset 18), one folder per family; a family Optimum cannot export is a
row of its own (``export-failed.txt``). ``run`` fuses every file (decoders also with
``--kv-cache shared``; fuse verifies each against its original on ORT CPU before writing),
then validates each fused decoder against its original over a prompt and 16 decode steps
(left-padded rows and not). It writes OUT/optimum-families.md: one row per file and run with
the exit code, the blocks fused of those found, the kernels they landed on, and the first
reason a block was left or a run stopped. Exit 0 whatever the rows say: it is a survey.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

SMALL = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 256}
GROUPED = {**SMALL, "num_key_value_heads": 2}
SEQ2SEQ = {"vocab_size": 128, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
           "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
           "decoder_ffn_dim": 128, "max_position_embeddings": 256, "pad_token_id": 1,
           "decoder_start_token_id": 2}
VISION = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "image_size": 32, "patch_size": 8}
CAUSAL, ENCODER, IMAGE, TEXT2TEXT = ("text-generation-with-past", "feature-extraction",
                                     "image-feature-extraction",
                                     "text2text-generation-with-past")

# family -> (task, config class, model class, config fields)
FAMILIES: dict[str, tuple[str, str, str, dict]] = {
    "stablelm": (CAUSAL, "StableLmConfig", "StableLmForCausalLM", GROUPED),
    "gpt_bigcode": (CAUSAL, "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4,
                     "n_positions": 256, "multi_query": True}),
    "gptj": (CAUSAL, "GPTJConfig", "GPTJForCausalLM",
             {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256,
              "rotary_dim": 8}),
    "codegen": (CAUSAL, "CodeGenConfig", "CodeGenForCausalLM",
                {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4,
                 "n_positions": 256, "n_ctx": 256, "rotary_dim": 8}),
    "gpt_neo": (CAUSAL, "GPTNeoConfig", "GPTNeoForCausalLM",
                {"vocab_size": 128, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                 "attention_types": [[["global", "local"], 1]], "window_size": 16,
                 "max_position_embeddings": 256}),
    "olmo": (CAUSAL, "OlmoConfig", "OlmoForCausalLM", GROUPED),
    "olmo2": (CAUSAL, "Olmo2Config", "Olmo2ForCausalLM", GROUPED),
    "granite": (CAUSAL, "GraniteConfig", "GraniteForCausalLM",
                {**GROUPED, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
                 "embedding_multiplier": 2.0, "logits_scaling": 4.0}),
    "cohere": (CAUSAL, "CohereConfig", "CohereForCausalLM", GROUPED),
    "phi": (CAUSAL, "PhiConfig", "PhiForCausalLM", {**SMALL, "partial_rotary_factor": 0.5}),
    "mpt": (CAUSAL, "MptConfig", "MptForCausalLM",
            {"vocab_size": 128, "d_model": 64, "n_layers": 2, "n_heads": 4,
             "max_seq_len": 256, "expansion_ratio": 2}),
    "gemma2": (CAUSAL, "Gemma2Config", "Gemma2ForCausalLM",
               {**GROUPED, "head_dim": 16, "sliding_window": 32}),
    # a cap that binds on these scores (Gemma 2's own 50 never does on random weights)
    "gemma2_capped": (CAUSAL, "Gemma2Config", "Gemma2ForCausalLM",
                      {**GROUPED, "head_dim": 16, "sliding_window": 8,
                       "attn_logit_softcapping": 5.0, "initializer_range": 0.2}),
    "gemma3_text": (CAUSAL, "Gemma3TextConfig", "Gemma3ForCausalLM",
                    {**GROUPED, "head_dim": 16, "sliding_window": 32}),
    "glm": (CAUSAL, "GlmConfig", "GlmForCausalLM", {**GROUPED, "head_dim": 16, "pad_token_id": 0}),
    "helium": (CAUSAL, "HeliumConfig", "HeliumForCausalLM", {**GROUPED, "head_dim": 16}),
    "nemotron": (CAUSAL, "NemotronConfig", "NemotronForCausalLM", GROUPED),
    "smollm3": (CAUSAL, "SmolLM3Config", "SmolLM3ForCausalLM", {**GROUPED, "pad_token_id": 0}),
    "arcee": (CAUSAL, "ArceeConfig", "ArceeForCausalLM", GROUPED),
    "xlm-roberta": (ENCODER, "XLMRobertaConfig", "XLMRobertaModel",
                    {**SMALL, "pad_token_id": 1}),
    "camembert": (ENCODER, "CamembertConfig", "CamembertModel", {**SMALL, "pad_token_id": 1}),
    "mpnet": (ENCODER, "MPNetConfig", "MPNetModel", SMALL),
    "roformer": (ENCODER, "RoFormerConfig", "RoFormerModel", {**SMALL, "embedding_size": 64}),
    "convbert": (ENCODER, "ConvBertConfig", "ConvBertModel", {**SMALL, "embedding_size": 64}),
    "data2vec-text": (ENCODER, "Data2VecTextConfig", "Data2VecTextModel", SMALL),
    "megatron-bert": (ENCODER, "MegatronBertConfig", "MegatronBertModel", SMALL),
    "mobilebert": (ENCODER, "MobileBertConfig", "MobileBertModel",
                   {**SMALL, "embedding_size": 32, "intra_bottleneck_size": 64,
                    "num_feedforward_networks": 1}),
    "esm": (ENCODER, "EsmConfig", "EsmModel", {**SMALL, "pad_token_id": 1}),
    "modernbert": (ENCODER, "ModernBertConfig", "ModernBertModel",
                   {**SMALL, "global_attn_every_n_layers": 2, "local_attention": 16,
                    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1,
                    "sep_token_id": 2}),
    "deberta-v2": (ENCODER, "DebertaV2Config", "DebertaV2Model",
                   {**SMALL, "relative_attention": True, "pos_att_type": ["p2c", "c2p"],
                    "position_buckets": 32, "max_relative_positions": -1,
                    "share_att_key": True, "norm_rel_ebd": "layer_norm"}),
    "deit": (IMAGE, "DeiTConfig", "DeiTModel", VISION),
    "beit": (IMAGE, "BeitConfig", "BeitModel", VISION),
    "data2vec-vision": (IMAGE, "Data2VecVisionConfig", "Data2VecVisionModel", VISION),
    "yolos": (IMAGE, "YolosConfig", "YolosModel", {**VISION, "image_size": [32, 32]}),
    "bart": (TEXT2TEXT, "BartConfig", "BartForConditionalGeneration", SEQ2SEQ),
    "mbart": (TEXT2TEXT, "MBartConfig", "MBartForConditionalGeneration", SEQ2SEQ),
    "marian": (TEXT2TEXT, "MarianConfig", "MarianMTModel", SEQ2SEQ),
    "pegasus": (TEXT2TEXT, "PegasusConfig", "PegasusForConditionalGeneration", SEQ2SEQ),
    "m2m_100": (TEXT2TEXT, "M2M100Config", "M2M100ForConditionalGeneration", SEQ2SEQ),
    "blenderbot": (TEXT2TEXT, "BlenderbotConfig", "BlenderbotForConditionalGeneration",
                   SEQ2SEQ),
    "mt5": (TEXT2TEXT, "MT5Config", "MT5ForConditionalGeneration",
            {"vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
             "num_decoder_layers": 2, "num_heads": 4}),
}


def make(out: Path, names: list[str]) -> None:
    """Export each family with Optimum (.venv-optimum)."""
    from tools.optimum_fixtures import optimum_export

    for name in names:
        task = FAMILIES[name][0]
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            optimum_export(*FAMILIES[name], folder)
        except Exception as exc:  # a survey: the reason is the row
            (folder / "export-failed.txt").write_text(f"{type(exc).__name__}: {exc}"[:600])
        (folder / "task.json").write_text(json.dumps({"task": task,
                                                       "config": FAMILIES[name][3]}))
        print(name, sorted(p.name for p in folder.iterdir()), flush=True)


def _cli(*args: str) -> tuple[int, dict | None, str]:
    run = subprocess.run([sys.executable, "-m", "mha_onnx.cli", *args, "--json"],
                         capture_output=True, text=True)
    try:
        report = json.loads(run.stdout)
    except json.JSONDecodeError:
        report = None
    lines = run.stderr.strip().splitlines() or [""]
    said = [line for line in lines if line.lower().startswith("error")] or lines[-1:]
    return run.returncode, report, said[0]


def _summary(report: dict | None, said: str) -> tuple[str, str, str]:
    """(fused / found, kernels, first reason) of a fuse report."""
    if not report or "blocks" not in report:
        return "-", "-", str((report or {}).get("error") or said)[:300]
    blocks = report["blocks"]
    fused = [b for b in blocks if b["status"] == "fused"]
    kernels = Counter(k for b in fused for k in _kernels(b["form"]))
    left = [b.get("reason") or "" for b in blocks if b["status"] != "fused"]
    verification = report.get("verification") or {}
    reason = left[0] if left else ("" if verification.get("passed", True) else
                                   "verification failed")
    return (f"{len(fused)} / {len(blocks)}",
            ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items())), reason[:300])


def _kernels(form: str) -> list[str]:
    return [k for k in ("GroupQueryAttention", "MultiHeadAttention", "MHA ", "Loop")
            if k in form]


def _validate(fused: Path, original: Path) -> str:
    code, report, said = _cli("validate", str(fused), "--reference", str(original))
    if report is None:
        return f"exit {code}: {said[:200]}"
    steps = sum(c["case"].startswith("decode step") for c in report.get("comparisons", []))
    return f"exit {code}, {steps} decode steps compared"


def run(out: Path, names: list[str]) -> list[str]:
    rows = ["| family | file | run | exit | time | fused | kernels | left / stopped | "
            "validate |", "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        folder = out / name
        task = json.loads((folder / "task.json").read_text())["task"]
        failed = folder / "export-failed.txt"
        if failed.exists():
            reason = failed.read_text().splitlines()[0][:300].replace("|", "\\|")
            rows.append(f"| {name} | - | Optimum export | - | - | - | - | {reason} | - |")
            print(rows[-1], flush=True)
            continue
        for onnx_file in sorted(folder.glob("*.onnx")):
            if ".fused" in onnx_file.name:
                continue
            runs = [("fuse", [])]
            if task == CAUSAL:
                runs.append(("fuse --kv-cache shared", ["--kv-cache", "shared"]))
            for label, extra in runs:
                target = onnx_file.with_suffix(f".fused{len(extra)}.onnx")
                started = time.perf_counter()
                code, report, said = _cli("fuse", str(onnx_file), "-o", str(target),
                                          "--force", *extra)
                took = time.perf_counter() - started
                fused, kernels, reason = _summary(report, said)
                checked = (_validate(target, onnx_file) if task == CAUSAL and code == 0
                           else "-")
                reason = reason.replace("|", "\\|")
                rows.append(f"| {name} | {onnx_file.stem} | {label} | {code} | {took:.0f} s | "
                            f"{fused} | {kernels} | {reason} | {checked} |")
                print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("make", "run"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(FAMILIES)
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families: {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.action == "make":
        make(args.out, names)
        return 0
    rows = run(args.out, names)
    command = "python -m tools.optimum_family_check " + " ".join(argv or sys.argv[1:])
    (args.out / "optimum-families.md").write_text(f"`{command}`\n\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
