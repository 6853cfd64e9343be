"""Bounds on what a reader accepts, so hostile or broken input ends in a clear error instead of a traceback or a
machine out of memory. Each limit is documented and overridable through the environment.

- ``json_depth_limit()``: how deeply a JSON document may nest (``$DPRO_MAX_JSON_DEPTH``, default 64; dpro's own
  files nest at most 6 deep, a Kineto trace's ``args`` a few more).
- ``world_size_limit()``: the most ranks a run may say it has (``$DPRO_MAX_WORLD_SIZE``, default 65,536): readers
  walk every rank, so a run.json claiming 10^12 would otherwise run for hours.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_JSON_DEPTH", "DEFAULT_WORLD_SIZE", "JSON_DEPTH_ENV", "WORLD_SIZE_ENV", "json_depth",
           "json_depth_limit", "parse_bounded_json", "world_size_limit"]

JSON_DEPTH_ENV = "DPRO_MAX_JSON_DEPTH"
DEFAULT_JSON_DEPTH = 64
WORLD_SIZE_ENV = "DPRO_MAX_WORLD_SIZE"
DEFAULT_WORLD_SIZE = 65_536


def _limit(variable: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(variable, default)))
    except ValueError:
        return default


def world_size_limit() -> int:
    """The most ranks a run may have (``$DPRO_MAX_WORLD_SIZE``, else ``DEFAULT_WORLD_SIZE``)."""
    return _limit(WORLD_SIZE_ENV, DEFAULT_WORLD_SIZE)


def json_depth_limit() -> int:
    """The deepest nesting a reader accepts (``$DPRO_MAX_JSON_DEPTH``, else ``DEFAULT_JSON_DEPTH``)."""
    return _limit(JSON_DEPTH_ENV, DEFAULT_JSON_DEPTH)


def json_depth(doc: Any, stop_at: int) -> int:
    """How deeply ``doc`` nests (a scalar: 0), counted level by level without recursion; stops counting past
    ``stop_at``. (A level at a time keeps the loop tight: a 200 MB trace is walked in about a second.)"""
    level = [doc] if type(doc) in (dict, list) else []
    depth = 0
    while level:
        depth += 1
        if depth > stop_at:
            return depth
        below: list[Any] = []
        keep = below.append
        for value in level:
            for child in value.values() if type(value) is dict else value:
                if type(child) is dict or type(child) is list:  # what json.loads makes: no subclasses
                    keep(child)
        level = below
    return depth


def parse_bounded_json(text: str | bytes, source: str | Path, error: Callable[[str | Path, str], Exception],
                       **loads: Any) -> Any:
    """``json.loads(text, **loads)`` that refuses a document nested deeper than ``json_depth_limit()`` with
    ``error(source, problem)`` (a ``TraceError`` or ``ConfigError``); ``json.JSONDecodeError`` is the caller's."""
    limit = json_depth_limit()
    try:
        doc = json.loads(text, **loads)
    except RecursionError:
        raise error(source, f"JSON nested deeper than Python's parser goes (dpro reads at most {limit} levels; "
                            f"${JSON_DEPTH_ENV} raises the limit)") from None
    if json_depth(doc, limit) > limit:
        raise error(source, f"JSON nested more than {limit} levels deep (${JSON_DEPTH_ENV} raises the limit)")
    return doc
