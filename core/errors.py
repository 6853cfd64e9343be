"""The errors dpro raises. Each message names the file (or argument) and what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "GraphError",
    "ConfigError",
    "DproError",
    "RecordingRefused",
    "TraceError",
    "UsageError",
    "kind_of",
    "shown",
]


def kind_of(value: Any) -> str:
    """A JSON value's kind, as messages name it: ``null``, ``str``, ``list``, ..."""
    return "null" if value is None else type(value).__name__


def shown(value: Any, width: int = 80) -> str:
    """``"<kind> <repr>"`` for a message, cut to ``width`` (an int of more than 4300 digits has no repr)."""
    try:
        text = f"{kind_of(value)} {value!r}"
    except ValueError:
        text = f"{kind_of(value)} of {value.bit_length()} bits"
    return text if len(text) <= width else text[:width - 3] + "..."



class DproError(Exception):
    """Root of every error dpro raises on purpose."""


class UsageError(DproError, ValueError):
    """A wrong argument to a dpro API or command (steps, run_dir, model, ...)."""


class RecordingRefused(UsageError, SystemExit):
    """A recording that cannot start (its run directory holds a run): a ``UsageError`` to code that catches it;
    uncaught, the process ends with exit status 2 and no traceback (rank 0 has printed the reason, once)."""

    def __init__(self, message: str) -> None:
        UsageError.__init__(self, message)
        self.code = 2


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

    def __reduce__(self) -> tuple[type, tuple[Path, str, str | None]]:
        # raised in a reading process (dpro.io.pool): it crosses back pickled, with its parts
        return (type(self), (self.path, self.problem, self.where))


class ConfigError(DproError):
    """An applied config (``config.json``) that cannot be read, or that does not fit the job.

    Args:
        source: the config file at fault (or the API that was handed the config).
        problem: what is wrong and how to fix it.
        key: optionally the key inside the config, e.g. ``knobs["recompute"]``.
    """

    def __init__(self, source: str | Path, problem: str, key: str | None = None) -> None:
        self.source = str(source)
        self.problem = problem
        self.key = key
        at = f" ({key})" if key else ""
        super().__init__(f"{self.source}{at}: {problem}")


class GraphError(DproError):
    """A step that cannot be modelled: ranks with no profiled step in common, a rank without step boundaries,
    a dependency cycle. The message names the run (or trace) and what is missing."""
