"""Option parsing and progress display shared by the CLI's commands."""

from __future__ import annotations

import json
import sys
from typing import Any

import click


def emit(report: Any, as_json: bool) -> None:
    """A report as JSON (``to_dict``) or as its human table (``render``)."""
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        click.echo(report.render())


def int_list(text: str, option: str) -> tuple[int, ...]:
    from mha_onnx.errors import ConfigError

    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"malformed {option} {text!r}", hint=f"e.g. {option} 128,512") from None
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{option} needs positive integers, got {text!r}")
    return values


def thread_counts(text: str | None) -> tuple[int | None, ...]:
    return (None,) if not text else int_list(text, "--threads")


def progress_bar():
    """A progress callback that draws a bar on stderr from the first point on."""
    state: dict = {}

    def step(done, total, label):
        if "bar" not in state:
            state["bar"] = click.progressbar(length=total, label="profiling", file=sys.stderr)
            state["bar"].__enter__()
        state["bar"].label = label
        if done > state["bar"].pos:
            state["bar"].update(done - state["bar"].pos)
        else:  # the first point: shown before it runs, not skipped
            state["bar"].render_progress()

    def close():
        if "bar" in state:
            state["bar"].__exit__(None, None, None)

    return step, close
