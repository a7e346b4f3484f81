"""`profile`: latency, throughput and memory sweeps."""

from __future__ import annotations

import click

from mha_onnx.cli.options import emit, int_list, progress_bar, thread_counts


@click.command("profile")
@click.argument("models", nargs=-1, required=True)
@click.option("--providers", default="cpu", show_default=True,
              help="Comma list: cpu,cuda,tensorrt,openvino,openvino-bf16 (openvino:GPU: another OpenVINO device).")
@click.option("--batch", "batches", default="1", show_default=True, help="Comma list of batch sizes.")
@click.option("--seq-lens", default="128,512,2048", show_default=True, help="Comma list of sequence lengths.")
@click.option("--warmup", type=int, default=3, show_default=True)
@click.option("--iters", type=int, default=None,
              help="Exactly this many timed runs per point (default: >= 10 runs and >= 0.3 s).")
@click.option("--min-time", type=float, default=None,
              help="Time each point for at least this many seconds (>= 3 runs).")
@click.option("--threads", default=None, help="Intra-op thread counts, e.g. 1,2 (default: ORT's).")
@click.option("--interleave/--no-interleave", default=None,
              help="Run the models of each point in turn in one process: fair ratios on a "
                   "busy machine, no memory figures (default when comparing 2+ models; "
                   "--no-interleave: each point in a child process, with memory).")
@click.option("--keep-going", is_flag=True,
              help="Finish the sweep when a point fails (the exit code is 1 all the same).")
@click.option("--io-binding", is_flag=True, help="Keep inputs/outputs on the device (CUDA).")
@click.option("--pad-fraction", type=float, default=0.0, show_default=True,
              help="Fraction of trailing keys padded in mask inputs.")
@click.option("--inputs", "inputs_npz", default=None, help="Feed these inputs (.npz) instead.")
@click.option("--decode", is_flag=True, help="KV-cache models: time one new token per step.")
@click.option("--context", default=None, help="With --decode: cache lengths, e.g. 128,1024,4096.")
@click.option("--no-ops", is_flag=True, help="Skip the per-op breakdown.")
@click.option("--no-memory-check", is_flag=True, help="Run points whose estimated memory exceeds what is free.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--csv", "csv_path", default=None, help="Also write the points as CSV.")
@click.option("--plot", "plot_path", default=None, help="Also draw latency/memory vs length (PNG).")
@click.option("--trace", "trace_dir", default=None, help="Keep ORT's Chrome-trace JSON here.")
@click.option("--force", is_flag=True, help="Replace existing --csv/--plot files and --trace traces.")
@click.pass_context
def profile(ctx, models, providers, batches, seq_lens, warmup, iters, min_time, threads,
            interleave, keep_going, io_binding, pad_fraction, inputs_npz, decode, context, no_ops,
            no_memory_check, as_json, csv_path, plot_path, trace_dir, force):
    """Latency percentiles, throughput, GFLOP/s vs roofline, memory and per-op time."""
    from mha_onnx.graph.files import prepare_folder, prepare_output
    from mha_onnx.profile import (
        DEFAULT_ITERS,
        DEFAULT_MIN_TIME,
        ProfileConfig,
        profile_models,
        write_csv,
    )
    from mha_onnx.profile import plot as draw
    from mha_onnx.runtime.ort import parse_providers

    for path in (csv_path, plot_path):  # refuse before the long run, not after it
        if path:
            prepare_output(path, force=force)
    if trace_dir:
        prepare_folder(trace_dir, force=force)
    if iters is None and min_time is None:
        iters, min_time = DEFAULT_ITERS, DEFAULT_MIN_TIME
    config = ProfileConfig(
        providers=parse_providers(providers), batches=int_list(batches, "--batch"),
        seq_lens=int_list(context or seq_lens, "--context" if context else "--seq-lens"),
        warmup=warmup, iters=iters, decode=decode,
        min_time=min_time, threads=thread_counts(threads), io_binding=io_binding, trace_dir=trace_dir,
        pad_fraction=pad_fraction, op_breakdown=not no_ops, memory_check=not no_memory_check,
        interleave=len(models) > 1 if interleave is None else interleave, inputs=inputs_npz,
        keep_going=keep_going)
    step, close = progress_bar()
    try:
        report = profile_models(models, config, on_point=step)
    finally:
        close()
    if csv_path:
        write_csv(report, csv_path, force=force)
    if plot_path:
        draw(report, plot_path, force=force)
    emit(report, as_json)
    ctx.exit(0 if report else 1)  # a failed point is no result
