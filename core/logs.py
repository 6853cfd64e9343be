"""dpro's diagnostics through ``logging``: one stderr handler on the ``dpro`` logger, prefixed by who speaks.

Loggers are ``dpro.<part>`` (``dpro.launch`` speaks as ``[dpro-launch]``, everything else as ``[dpro]``).
The level is INFO unless ``$DPRO_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR) or a command's ``-v``/``-q``
says otherwise. Results go to stdout as tables and files, never through here.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOG_LEVEL_ENV", "get_logger", "set_verbosity"]

LOG_LEVEL_ENV = "DPRO_LOG_LEVEL"
_PREFIXES = (("dpro.launch", "[dpro-launch]"), ("dpro", "[dpro]"))


class _PrefixFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = next(p for name, p in _PREFIXES if record.name == name or record.name.startswith(name + ".")
                      or name == "dpro")
        return f"{prefix} {record.getMessage()}"


def _root() -> logging.Logger:
    root = logging.getLogger("dpro")
    if not any(getattr(h, "_dpro", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_PrefixFormatter())
        handler._dpro = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False  # the handler above speaks; an application's root handlers would repeat it
        level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
        root.setLevel(level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO")
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` (under ``dpro``), with dpro's stderr handler installed once."""
    _root()
    return logging.getLogger(name)


def set_verbosity(verbose: int = 0, quiet: int = 0) -> None:
    """``-v`` (DEBUG) / ``-q`` (WARNING, ``-qq`` ERROR) of a command line."""
    level = logging.INFO - 10 * verbose + 10 * quiet
    _root().setLevel(min(max(level, logging.DEBUG), logging.ERROR))
