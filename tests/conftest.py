"""Fixtures shared by the tests; the run-directory builders live in run_builder.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from run_builder import make_run


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A valid, complete two-rank run profiling steps 3..7."""
    return make_run(tmp_path / "run")


@pytest.fixture
def new_run(tmp_path: Path) -> Callable[..., Path]:
    """``make_run`` under ``tmp_path``: ``new_run(ranks=[0])``."""
    return lambda **kw: make_run(tmp_path / "run", **kw)
