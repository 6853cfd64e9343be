"""Horovod's knobs as dpro names them (its environment variables), their defaults in horovod 0.28.1, and the
knobs in force in a rank's environment: shared by the engine (``dpro.engines.horovod``) and its search."""

from __future__ import annotations

from typing import Any

__all__ = ["CACHE", "CYCLE", "DEFAULT_CYCLE_TIME_MS", "DEFAULT_FUSION_THRESHOLD", "NAME", "THRESHOLD",
           "knobs_from_environment", "knobs_set_by"]

NAME = "horovod"
THRESHOLD, CYCLE, CACHE = "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY"
DEFAULT_FUSION_THRESHOLD = 128 * 2**20   # horovod 0.28.1 (operations.cc)
DEFAULT_CYCLE_TIME_MS = 1.0


def knobs_from_environment(environ: dict[str, str]) -> dict[str, Any]:
    """The Horovod knobs in force in a rank's environment (what the recorders store in run.json), else Horovod's
    defaults; a value Horovod would not parse is kept as text, for ``dpro.config`` to report."""
    knobs: dict[str, Any] = {}
    try:
        knobs[THRESHOLD] = int(environ.get(THRESHOLD, DEFAULT_FUSION_THRESHOLD))
    except ValueError:
        knobs[THRESHOLD] = environ[THRESHOLD]
    try:
        knobs[CYCLE] = float(environ.get(CYCLE, DEFAULT_CYCLE_TIME_MS))
    except ValueError:
        knobs[CYCLE] = environ[CYCLE]
    knobs["horovod.autotune"] = environ.get("HOROVOD_AUTOTUNE", "0") not in ("", "0", "false", "False")
    try:
        knobs["horovod.cache_capacity"] = int(environ.get(CACHE, "1024") or 1024)
    except ValueError:
        knobs["horovod.cache_capacity"] = environ[CACHE]
    return knobs


def knobs_set_by(env: dict[str, str]) -> dict[str, Any]:
    """The fusion threshold, cycle time and cache capacity that a config's ``env`` section sets (none of the
    defaults it leaves alone), parsed as ``knobs_from_environment`` parses them."""
    parsed = knobs_from_environment(env)
    named = ((THRESHOLD, THRESHOLD), (CYCLE, CYCLE), (CACHE, "horovod.cache_capacity"))
    return {knob: parsed[key] for knob, key in named if knob in env}
