"""The ``Engine`` interface: what the core asks of a communication engine (plain data and functions)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GENERIC", "Engine"]


def _no_groups(ctx: Any, knobs: dict[str, Any]) -> None:
    return None


def _nothing(run: Any) -> None:
    return None


def _common_search(ctx: Any, **options: Any) -> Any:
    from dpro.optimize.search import optimize_common

    return optimize_common(ctx, **options)


@dataclass(frozen=True)
class Engine:
    """One communication engine.

    Attributes:
        name: as written in run.json (``engine``) and in a config's fingerprint.
        doc: one line for tables and help.
        knobs: the engine's own knobs (``dpro.config.Knob``, with ``engine`` set).
        groups: ``(ctx, knobs) -> list of gradient-name groups or None``: how the engine would group the
            gradients into collectives under ``knobs`` (what-if); None when ``knobs`` change no grouping.
        optimize: ``(ctx, memory_budget_bytes=, allow_compression=) -> OptimizeResult``: the engine's search.
        prepare_run: ``(run) -> None``, at load time: complete the run from the engine's own traces.
        apply: how a config reaches the job, in words (for docs and tables).
    """

    name: str
    doc: str
    knobs: tuple = ()
    groups: Callable[[Any, dict[str, Any]], list[list[str]] | None] = _no_groups
    optimize: Callable[..., Any] = _common_search
    prepare_run: Callable[[Any], None] = _nothing
    apply: str = ""
    comm_knobs: tuple[str, ...] = field(default=())  # knob names that regroup the collectives

    def knob_names(self) -> list[str]:
        return [k.name for k in self.knobs]


GENERIC = Engine(name="generic", doc="a job without an engine dpro models (one process, plain collectives)")
