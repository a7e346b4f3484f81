"""`fuse`: every attention block onto a fused kernel, verified."""

from __future__ import annotations

import click

from mha_onnx.cli.options import emit
from mha_onnx.cli.tune import run_tune, tune_options
from mha_onnx.rewrite.policy import EPS, KV_CACHES, TARGETS, form_help


@click.command("fuse")
@click.argument("model")
@click.option("-o", "--output", required=True, help="Where to write the fused model.")
@click.option("--target", type=click.Choice(TARGETS), default="ort",
              show_default=True,
              help="ort: ONNX Runtime contrib kernels; onnx: the standard Attention op (opset 23); "
                   "openvino: onnx's standard ops, verified on OpenVINO as well.")
@click.option("--ep", type=click.Choice(EPS), default="cpu",
              show_default=True,
              help="Execution provider the model will run on (target ort): the forms measured "
                   "fastest there (docs/fusion-forms.md for cpu, docs/gpu/ for cuda; tensorrt "
                   "runs ORT's attention kernels on CUDA).")
@click.option("--form", "forms", multiple=True,
              help=f"Override a kernel form (target ort): {form_help()}. Defaults: those of "
                   "--ep.")
@click.option("--kv-cache", "kv_cache", type=click.Choice(KV_CACHES),
              default=None,
              help="KV-cache models: appended (the default) keeps the interface (presents = "
                   "pasts + new); shared makes each past a max-length buffer updated in place "
                   "(bind past and present to one buffer; the cached length read from the "
                   "mask's shape, else a past_sequence_length input).")
@click.option("--logits", type=click.Choice(["all", "last"]), default="all", show_default=True,
              help="Decoders: last computes the LM head for each row's last kept position "
                   "only (logits [batch, 1, vocab]: what a generation loop reads).")
@click.option("--no-verify", is_flag=True, help="Skip the parity check against the original.")
@click.option("--atol", type=float, default=None, help="Verification tolerance (default by dtype).")
@click.option("--rtol", type=float, default=None)
@click.option("--inputs", "inputs_npz", default=None,
              help="Verify with these inputs (.npz, one array per input) instead of generated ones.")
@click.option("--strict", is_flag=True,
              help="Exit 1 and write nothing when any attention block is left unfused.")
@tune_options
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def fuse(model, output, target, ep, forms, kv_cache, logits, no_verify, atol, rtol, inputs_npz,
         strict, tune, tune_batch, tune_seq_lens, tune_threads, tune_max_size, tune_budget, force,
         as_json):
    """Rewrite every attention block onto the fastest fused kernel, verified against the
    original on ORT CPU before anything is written."""
    from mha_onnx.errors import ConfigError
    from mha_onnx.rewrite import FormPolicy, fuse_file

    policy = FormPolicy.parse(forms, ep, target=target, kv_cache=kv_cache)
    if tune and (not policy.is_default() or logits != "all"):
        raise ConfigError("--tune chooses the forms itself, on this machine's CPU",
                          hint="drop --target/--ep/--form/--kv-cache/--logits, or drop --tune")
    if tune:
        return emit(run_tune(model, output, tune_batch, tune_seq_lens, tune_threads, force,
                             tune_max_size, tune_budget), as_json)

    if policy.target == "ort":
        _refuse_a_second_genai_model(model, output, force)
    report = fuse_file(model, output, policy=policy, verify_result=not no_verify, force=force,
                       atol=atol, rtol=rtol, inputs=inputs_npz, strict=strict, logits=logits)
    if policy.target == "ort":  # a decoder: GenAI's folder beside it
        from dataclasses import replace

        from mha_onnx.generate.genai import deliver_genai

        note = deliver_genai(output, model)
        report = replace(report, notes=(*report.notes, note)) if note else report
    emit(report, as_json)


def _refuse_a_second_genai_model(model, output, force: bool) -> None:
    """A decoder fused into a folder whose genai_config.json names another model: refused
    before the fusion (its GenAI config would be replaced)."""
    from mha_onnx.generate.genai import genai_clash
    from mha_onnx.graph.cache import cache_pairs
    from mha_onnx.graph.files import read_model

    if cache_pairs(read_model(model, load_external_data=False)):
        genai_clash(output, force)
