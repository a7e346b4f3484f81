"""The CLI of tuning: `fuse --tune` options and the `tune` command (see mha_onnx.tune)."""

from __future__ import annotations

import json

import click

from mha_onnx.cli.options import int_list


class _Times(click.ParamType):
    """A size ratio: ``1.1`` or ``1.1x``, at least 1 (the default fusion alone is 1.0x)."""

    name = "RATIO"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        text = str(value).strip().lower().removesuffix("x")
        try:
            ratio = float(text)
        except ValueError:
            self.fail(f"{value!r} is not a ratio such as 1.1 or 1.1x", param, ctx)
        if not ratio >= 1.0:
            self.fail(f"{value!r}: a tuned model holds the default fusion at least (1.0x)",
                      param, ctx)
        return ratio


def tune_options(command):
    """--tune and its grid, for `fuse`."""
    for option in reversed([
        click.option("--tune", is_flag=True,
                     help="Time every form (and the original) on this machine over a batch x "
                          "length grid and dispatch on the batch and length to the fastest (ORT "
                          "target)."),
        click.option("--tune-batch", default="1,8,32", show_default=True,
                     help="Batch sizes of the tuning grid."),
        click.option("--tune-seq-lens", default="16,64,256,1024,4096", show_default=True,
                     help="Lengths of the tuning grid."),
        click.option("--tune-threads", type=int, default=None,
                     help="Intra-op threads to tune for (the deployment's; default: ORT's)."),
        click.option("--tune-max-size", type=_Times(), default="1.1x", show_default=True,
                     help="The tuned model's size at most this many times the original's "
                          "(candidates whose weights do not fit are left out)."),
        click.option("--tune-budget", type=float, default=150.0, show_default=True,
                     help="Seconds the timing may take: past them the largest points are "
                          "not timed (their rules are the shorter lengths')."),
    ]):
        command = option(command)
    return command


def run_tune(model: str, output: str, batches: str, seq_lens: str, threads: int | None,
             force: bool, max_size: float = 1.1, budget: float = 150.0):
    from mha_onnx.tune.rules import TuneConfig
    from mha_onnx.tune.run import tune_model

    cfg = TuneConfig(batches=int_list(batches, "--tune-batch"),
                     seq_lens=int_list(seq_lens, "--tune-seq-lens"), threads=threads,
                     max_size=max_size, budget=budget)
    return tune_model(model, output, cfg, force=force,
                      progress=lambda line: click.echo(f"[tune] {line}", err=True))


@click.command("tune")
@click.argument("model")
@click.option("-o", "--output", required=True, help="Where to write the tuned model.")
@tune_options
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def tune_command(model, output, tune, tune_batch, tune_seq_lens, tune_threads, tune_max_size,
                 tune_budget, force, as_json):
    """Fuse MODEL with every form, time them (and MODEL itself) on this machine, and write a
    model that runs the fastest for each batch and length (`fuse --tune`; run it on the
    target)."""
    del tune  # `tune` always tunes
    report = run_tune(model, output, tune_batch, tune_seq_lens, tune_threads, force,
                      tune_max_size, tune_budget)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.render())
