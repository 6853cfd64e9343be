"""Fixtures shared by the tests; the run-directory builders live in run_builder.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from run_builder import make_run

TESTS = Path(__file__).resolve().parent
FRAMEWORK_BOUND = ("launch/", "plugins/torch/", "plugins/tf/")
"""Folders of tests/ whose tests need dpro-launch's venv or a framework other than MXNet; every other test is
``core``: `make test` runs those in the MXNet venv too (numpy < 1.24, no torch or TensorFlow), so a new core test
is picked up there by where it lives. A core test that needs an optional package skips without it
(``pytest.importorskip``)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        where = Path(str(item.fspath)).resolve()
        if where.is_relative_to(TESTS) and not where.relative_to(TESTS).as_posix().startswith(FRAMEWORK_BOUND):
            item.add_marker(pytest.mark.core)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A valid, complete two-rank run profiling steps 3..7."""
    return make_run(tmp_path / "run")


@pytest.fixture
def new_run(tmp_path: Path) -> Callable[..., Path]:
    """``make_run`` under ``tmp_path``: ``new_run(ranks=[0])``."""
    return lambda **kw: make_run(tmp_path / "run", **kw)
