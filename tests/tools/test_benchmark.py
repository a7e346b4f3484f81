"""tools/benchmark.py: one benchmark tool with suites over one skeleton (tools/suite.py). The
listing and a refused suite name, and one real short run of a suite: its table names the
date, the command that reproduces it and the machine, and holds every point asked for."""

from __future__ import annotations

import pytest

from tools import benchmark, suite


def test_the_listing_names_every_suite(capsys):
    assert benchmark.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name in suite.SUITES:
        assert f"  {name} " in listed


def test_an_unknown_suite_is_refused_with_the_listing(capsys):
    assert benchmark.main(["nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err
    assert benchmark.main([]) == 2


def test_every_suite_names_a_module_with_a_main():
    import importlib

    for module, _ in suite.SUITES.values():
        assert callable(importlib.import_module(module).main)


@pytest.mark.slow
def test_a_short_kv_run_writes_its_table_with_the_command(tmp_path):
    out = tmp_path / "kv.md"
    args = ["kv", "--context", "8,16", "--batch", "1", "--min-time", "0.02",
            "--threads", "1", "--out", str(out)]
    assert benchmark.main(args) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("Measured ")
    assert "`.venv/bin/python -m tools.benchmark " + " ".join(args) + "`" in lines[0]
    rows = [line for line in lines if line.startswith("| 1 |")]
    assert [row.split(" | ")[1] for row in rows] == ["8", "16"]
    for row in rows:  # three p50s and two ratios, all numbers
        cells = row.strip("| ").split(" | ")[2:]
        assert len(cells) == 5 and all(float(c) > 0 for c in cells)
