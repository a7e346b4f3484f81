"""The command group: one place that turns the package's errors and click's usage errors
into one line, a hint and an exit code."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from typing import Any

import click

from mha_onnx import __version__
from mha_onnx.errors import EXIT_INTERNAL, MhaOnnxError


class _Group(click.Group):
    """Catches the package's errors and click's usage errors once: one line with a hint, an
    exit code, no traceback (``-v`` prints the traceback too)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = _verbose_first(sys.argv[1:] if args is None else list(args))
        self.as_json = "--json" in args
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:  # bad options, missing arguments
            where = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) else ""
            click.echo(f"error: {exc.format_message()}{where}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: interrupted; no output was written", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        from mha_onnx.graph.files import remove_empty_outputs

        try:
            return super().invoke(ctx)
        except MhaOnnxError as exc:
            remove_empty_outputs()
            self._fail(ctx, exc.message, exc.hint, exc.exit_code, type(exc).__name__)
        except KeyboardInterrupt:
            remove_empty_outputs()
            click.echo("error: interrupted; no output was written", err=True)
            ctx.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:  # a bug of mha-onnx, not the user's input
            remove_empty_outputs()
            self._fail(ctx, f"internal error: {type(exc).__name__}: {str(exc)[:300]}",
                       "please report it with the output of -v (the traceback)", EXIT_INTERNAL,
                       "InternalError")

    def _fail(self, ctx: click.Context, message: str, hint: str | None, code: int,
              kind: str) -> None:
        """One line on stderr (a JSON object on stdout under --json), then the exit code."""
        if ctx.obj and ctx.obj.get("verbose"):
            traceback.print_exc()
        if getattr(self, "as_json", False):
            click.echo(json.dumps({"error": message, "hint": hint, "kind": kind,
                                   "exit_code": code}, indent=2))
        else:
            click.echo(f"error: {message}" + (f" (hint: {hint})" if hint else ""), err=True)
        ctx.exit(code)


def _verbose_first(args: list[str]) -> list[str]:
    """``-v`` anywhere on the line (``mha-onnx fuse m.onnx -o f.onnx -v``, as the hints say
    it) is the group's option: moved before the command."""
    flags = [a for a in args if a == "--verbose" or (len(a) > 1 and a[0] == "-"
                                                     and set(a[1:]) == {"v"})]
    return flags + [a for a in args if a not in flags] if flags else args


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging; -v also shows tracebacks.")
@click.version_option(__version__, prog_name="mha-onnx")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Multi-head attention from PyTorch to ONNX Runtime: export, fuse, validate, profile."""
    ctx.obj = {"verbose": verbose}
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if verbose < 2:
        for noisy in ("onnxscript", "onnx_ir", "torch"):  # their warnings are not the user's
            logging.getLogger(noisy).setLevel(logging.ERROR)
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
