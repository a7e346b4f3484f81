"""The benchmarks, one tool with suites.

    .venv/bin/python -m tools.benchmark SUITE [options]   # SUITE --help: its options
    .venv/bin/python -m tools.benchmark --list

Every suite builds its graphs in a scratch folder, times them in turn in one process
(mha_onnx.profile: sleeping thread pools, at least --min-time seconds per model per point),
and prints a markdown table whose first line names the date, the command and the machine
(--out writes it to a file). Results live in docs/ beside the command that made them.
"""

from __future__ import annotations

import importlib
import sys

from tools.suite import SUITES


def listing() -> str:
    width = max(len(name) for name in SUITES)
    return "\n".join(f"  {name:<{width}}  {about}" for name, (_, about) in SUITES.items())


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "--list"):
        print(__doc__.strip().splitlines()[0] + "\n\nsuites:\n" + listing())
        return 0 if args else 2
    suite = args[0]
    if suite not in SUITES:
        print(f"unknown suite {suite!r}; suites:\n{listing()}", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[suite][0]).main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
