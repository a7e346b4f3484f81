"""Shared fixtures: exported models are cached per session (torch.export is the slow part)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)
logging.getLogger("onnxscript").setLevel(logging.WARNING)
logging.getLogger("onnx_ir").setLevel(logging.WARNING)

from mha_onnx.config import MhaConfig  # noqa: E402

SMALL = MhaConfig(d_model=32, num_heads=4, name="small")


@pytest.fixture(scope="session")
def export_cache(tmp_path_factory: pytest.TempPathFactory):
    """export_cache(config, **kw) -> path of an export of ``config`` (made once per session)."""
    from mha_onnx.export import export_model

    folder = tmp_path_factory.mktemp("exports")
    cache: dict[tuple, Path] = {}

    def get(config: MhaConfig, **kwargs) -> Path:
        key = (config, tuple(sorted(kwargs.items())))
        if key not in cache:
            path = folder / f"m{len(cache)}.onnx"
            export_model(config, path, **kwargs)
            cache[key] = path
        return cache[key]

    return get


@pytest.fixture(scope="session")
def zoo():
    """zoo(name) -> a graph exported from code this project did not write (tests/models.py),
    made once per session."""
    from tests.models import ZOO

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = ZOO[name]()
        return cache[name]

    return get


SLOW_FIXTURES = {"zoo", "export_cache", "hf_folder"}  # torch.export behind them: seconds per model


def pytest_collection_modifyitems(config, items):
    """A fast suite (STYLE.md rule 21): what needs torch.export is ``slow``, so that
    ``pytest -m "not slow"`` runs in about a minute; ``make test`` runs everything."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
