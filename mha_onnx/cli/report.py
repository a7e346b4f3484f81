"""`report`: profiles of several machines side by side."""

from __future__ import annotations

import click

from mha_onnx.cli.options import emit


@click.command("report")
@click.argument("profiles", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="The markdown report to write.")
@click.option("--plot", "plot_path", default=None, help="Also draw the targets side by side (PNG).")
@click.option("--force", is_flag=True, help="Replace existing output files.")
@click.option("--json", "as_json", is_flag=True, help="Print the merged table as JSON.")
def report(profiles, output, plot_path, force, as_json):
    """Merge profile --json files from several machines and providers into one table."""
    from mha_onnx.profile.merge import merge_profiles, write_report

    merged = merge_profiles(list(profiles))
    write_report(merged, output, plot_path, force=force)
    emit(merged, as_json)
