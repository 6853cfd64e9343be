"""The errors dpro raises. Each message names the file (or argument) and what is wrong."""

from __future__ import annotations

from pathlib import Path


class DproError(Exception):
    """Root of every error dpro raises on purpose."""


class UsageError(DproError, ValueError):
    """A wrong argument to a dpro API or command (steps, run_dir, model, ...)."""


class TraceError(DproError):
    """A run directory or trace file that cannot be read as dpro expects.

    Args:
        path: the file (or directory) at fault.
        problem: what is wrong, in words a user can act on.
        where: optionally the event, line or key inside the file.
    """

    def __init__(self, path: str | Path, problem: str, where: str | None = None) -> None:
        self.path = Path(path)
        self.problem = problem
        self.where = where
        at = f" ({where})" if where else ""
        super().__init__(f"{self.path}{at}: {problem}")
