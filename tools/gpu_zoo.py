"""Graphs exported elsewhere, fused here, checked on another provider (a GPU machine).

    .venv/bin/python -m tools.gpu_zoo build DIR [--only NAME,...]
    python3 -m tools.gpu_zoo check DIR --providers cpu,cuda [--md FILE] [--json FILE]
    ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1 python3 -m tools.gpu_zoo kernels DIR --providers cuda

``build`` (here, where torch.export and transformers are pinned) writes ``NAME.onnx`` and
``NAME.fused.onnx`` for a set of graphs that covers every fused form: nn.MultiheadAttention,
SDPA at opsets 18 and 23, Hugging Face encoders, decoders (GQA, windows, soft-cap, ALiBi as
a bias) in float32 and float16, and decoders with a KV cache (appended and shared). ``check``
(on the GPU machine, which needs no transformers) validates each fused graph against its
original on every provider, decode steps included, and records per provider the worst error,
the nodes ORT placed on the CPU and the fused kernels. Exit 1 if any check failed.
``kernels`` runs each fused graph once unpadded and once padded, so that ORT (with the
variable above) prints which attention kernel each fused node ran.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

EP_CUDA = ".ep-cuda"  # NAME.ep-cuda.fused.onnx: fused with `--ep cuda`
SETS = {
    "torch_mha_key_padding": ("zoo", "torch_mha_key_padding"),
    "torch_mha_causal_float": ("zoo", "torch_mha_causal_float"),
    "sdpa23_causal": ("zoo", "sdpa23_causal"),
    "sdpa18_key_padding": ("zoo", "sdpa18_key_padding"),
    "sdpa18_float": ("zoo", "sdpa18_float"),
    "hf_bert": ("zoo", "hf_bert_eager"),
    "hf_t5": ("zoo", "hf_t5"),
    "hf_vit": ("zoo", "hf_vit"),
    "hf_bart": ("zoo", "hf_bart"),
    "hf_llama": ("decoder", "llama", "sdpa", 18, "float32"),
    "hf_llama_fp16": ("decoder", "llama", "sdpa", 18, "float16"),
    "hf_gpt2_fp16": ("decoder", "gpt2", "eager", 23, "float16"),
    "hf_mistral_fp16": ("decoder", "mistral", "eager", 18, "float16"),
    "hf_gemma2": ("decoder", "gemma2", "eager", 18, "float32"),
    "hf_bloom": ("decoder", "bloom", "eager", 18, "float32"),
    "hf_cached_llama": ("cached", "llama"),
    "hf_cached_qwen2_shared": ("cached", "qwen2", "shared"),
}


def build(folder: Path, only: list[str] | None) -> int:
    import onnx

    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.policy import FormPolicy
    from tools import zoo

    folder.mkdir(parents=True, exist_ok=True)
    for name, spec in SETS.items():
        if only and name not in only:
            continue
        if spec[0] == "zoo":
            model = zoo.ZOO[spec[1]]()
        elif spec[0] == "decoder":
            model = zoo.hf_decoder(spec[1], spec[2], spec[3], spec[4])
        else:
            model = zoo.hf_cached_decoder(spec[1])
        kv_cache = spec[2] if spec[0] == "cached" and len(spec) > 2 else "appended"
        onnx.save(model, folder / f"{name}.onnx")
        report = fuse_file(folder / f"{name}.onnx", folder / f"{name}.fused.onnx", force=True,
                           policy=FormPolicy(kv_cache=kv_cache))
        print(name, "|", "; ".join(b.form for b in report.blocks), flush=True)
        # the forms `fuse --ep cuda` picks, checked on CUDA beside the CPU ones
        report = fuse_file(folder / f"{name}.onnx", folder / f"{name}{EP_CUDA}.fused.onnx",
                           force=True, policy=FormPolicy.parse([], "cuda", kv_cache=kv_cache))
        print(name, "--ep cuda |", "; ".join(b.form for b in report.blocks), flush=True)
    return 0


def reference_of(fused: Path) -> Path:
    """The original a fused graph of the zoo came from (NAME.onnx for NAME[.ep-cuda].fused.onnx)."""
    name = fused.name[: -len(".fused.onnx")].removesuffix(EP_CUDA)
    return fused.with_name(f"{name}.onnx")


def check(folder: Path, providers: tuple[str, ...], md: str | None, out: str | None) -> int:
    from mha_onnx.errors import MhaOnnxError
    from mha_onnx.graph.files import read_model
    from mha_onnx.parity import ValidateConfig, validate_model

    rows, ok = [], True
    for fused in sorted(folder.glob("*.fused.onnx")):
        name = fused.name[: -len(".fused.onnx")]
        start = time.perf_counter()
        row: dict = {"model": name}
        try:
            graph = read_model(fused)
            row["kernels"] = sorted({n.op_type for n in graph.graph.node
                                     if n.domain == "com.microsoft" or n.op_type in ("If", "Loop")})
            report = validate_model(fused, ValidateConfig(providers=providers,
                                                          reference=str(reference_of(fused))))
            row["passed"] = bool(report)
            row["providers"] = {p.provider: {"ran": p.ran, "reason": p.reason,
                                             "nodes_on_cpu": list(p.cpu_nodes)}
                                for p in report.providers}
            worst: dict[str, float] = {}
            for c in report.comparisons:
                key = f"{c.provider} vs {c.against}"
                worst[key] = max(worst.get(key, 0.0), c.stats.max_abs)
            row["worst"] = worst
            row["decode_steps"] = sum(c.case.startswith("decode step") for c in report.comparisons)
            row["failed"] = [f"{c.output} {c.provider} vs {c.against} @ {c.case}: {c.stats.max_abs:.2e}"
                             for c in report.comparisons if not c.stats.passed][:5]
        except MhaOnnxError as exc:
            row["passed"], row["error"] = False, str(exc)
        except Exception as exc:  # a bug in the tool must not hide the other rows
            row["passed"], row["error"] = False, f"{type(exc).__name__}: {exc}"
        row["seconds"] = round(time.perf_counter() - start, 1)
        ok &= row["passed"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = ["| graph | kernels | worst max abs | nodes on the CPU | passed |", "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {', '.join(row.get('kernels', []))} | "
                         f"error: {row['error'][:300]} | | NO |")
            continue
        worst = "; ".join(f"{k} {v:.1e}" for k, v in sorted(row["worst"].items()))
        cpu = "; ".join(f"{p}: {', '.join(s['nodes_on_cpu'][:6]) or '-'}"
                        for p, s in row["providers"].items() if p != "cpu")
        lines.append(f"| {row['model']} | {', '.join(row['kernels'])} | {worst} | {cpu} | "
                     f"{'yes' if row['passed'] else 'NO: ' + ' / '.join(row['failed'])} |")
    if md:
        Path(md).write_text("\n".join(lines) + "\n")
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return 0 if ok else 1


def kernels(folder: Path, provider: str) -> int:
    from mha_onnx.graph.files import read_model
    from mha_onnx.graph.inputs import case_for, input_specs, make_inputs
    from mha_onnx.runtime.ort import OrtRunner

    for path in sorted(folder.glob("*.fused.onnx")):
        model = read_model(path)
        fused = [f"{n.name}:{n.op_type}" for n in model.graph.node
                 if n.domain == "com.microsoft" or n.op_type in ("If", "Loop")]
        specs = input_specs(model)
        for padding in ("none", "some"):
            print("== kernels of", path.name, "padding", padding, "nodes:", " ".join(fused),
                  flush=True)
            try:
                feeds = make_inputs(specs, case_for(specs, padding, 2, [64], padding=padding))
                with OrtRunner(path, provider, io_binding=provider != "cpu", strict=False) as run:
                    run.infer(feeds)
            except Exception as exc:  # a graph that cannot run here is reported, not fatal
                print("  could not run:", exc, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("build", "check", "kernels"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--only", default=None)
    parser.add_argument("--providers", default="cpu,cuda")
    parser.add_argument("--md", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.action == "build":
        return build(args.folder, args.only.split(",") if args.only else None)
    if args.action == "kernels":
        return kernels(args.folder, args.providers.split(",")[0])
    return check(args.folder, tuple(args.providers.split(",")), args.md, args.json)


if __name__ == "__main__":
    sys.exit(main())
