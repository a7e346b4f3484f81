"""Where the suite's files live, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository
FIXTURES = TESTS / "fixtures"  # committed exports (optimum/, genai/), made by `make fixtures`
OPTIMUM = FIXTURES / "optimum"
