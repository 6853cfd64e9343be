"""Stage 6, optimize: ``optimize`` hands the run to its engine's search (``dpro.engines``: bucket caps, fusion
thresholds, cycle times), each candidate priced by replay; an engine without a search of its own gets the searches
every engine shares (``dpro.sim.choices``, where the engines' searches find their building blocks).
``config_document`` turns a result into the applied config (``dpro.config`` schema) with its ``explain`` list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpro.config import Config, write_config
from dpro.engines import get_engine
from dpro.progress import Progress
from dpro.record.trace import write_text_atomic
from dpro.sim.choices import (
    OptimizeResult,
    optimize_common,
    probed_choices,
)
from dpro.sim.whatif import Context

__all__ = ["config_document", "optimize", "write_config_files"]


def optimize(ctx: Context, *, memory_budget_bytes: int | None = None, allow_compression: bool = False,
             allow_precision: bool = False, progress: Progress | None = None) -> OptimizeResult:
    """Search the knobs of the run's engine (``dpro.engines``), recomputation under a memory budget and
    compression; then what the probe passes price (``sim.choices.probed_choices``: micro-batches against
    recomputation under the budget, autocast precision with ``allow_precision``); every answer is confirmed by replay.

    Args:
        progress: advanced once per configuration replayed (``dpro.progress.Progress``; its total is
            unknown ahead: each engine's search decides how many candidates it prices), closed at the end.
    """
    search = get_engine(ctx.engine).optimize or optimize_common  # an engine without a search of its own

    def searched() -> OptimizeResult:
        result = search(ctx, memory_budget_bytes=memory_budget_bytes, allow_compression=allow_compression)
        return probed_choices(ctx, result, memory_budget_bytes=memory_budget_bytes, allow_precision=allow_precision)

    if progress is None:
        return searched()
    before = ctx.on_predict
    ctx.on_predict = lambda knobs: progress.advance(note=_knobs_note(knobs))
    try:
        return searched()
    finally:
        ctx.on_predict = before
        progress.close()


def _knobs_note(knobs: dict[str, Any]) -> str:
    """A short description of a candidate for a progress line (tensor groups counted, not listed)."""
    shown = [f"{k}={len(v)} groups" if k == "tensor_groups" else f"{k}={v}" for k, v in knobs.items()]
    text = ", ".join(shown) or "the run as recorded"
    return text if len(text) <= 60 else text[:57] + "..."


def write_config_files(path: str | Path, doc: dict[str, Any]) -> list[Path]:
    """Write the applied config ``doc`` to ``path`` and, beside it, the files its engine's launcher reads
    (``Engine.launcher_files``, e.g. a launcher's own config file); returns the files written."""
    path = Path(path)
    written = [write_config(path, Config.from_json(doc))]
    engine = get_engine((doc.get("fingerprint") or {}).get("engine"))
    for name, text in engine.launcher_files(doc).items():
        write_text_atomic(path.parent / name, text)
        written.append(path.parent / name)
    return written


def config_document(result: OptimizeResult, ctx: Context) -> dict[str, Any]:
    """The applied config (docs/architecture.md "The applied config") for ``result``."""
    meta = ctx.run.meta or {}
    return {
        "schema": "dpro.config/1",
        "fingerprint": {"framework": meta.get("framework", "torch"), "engine": ctx.engine,
                        "world_size": ctx.run.world_size, "model": meta.get("model_fingerprint", "")},
        "baseline": {"run": str(ctx.run.path), "step_ms": result.measured_step_ms},
        "predicted": {"step_ms": result.predicted.predicted_step_ms,
                      "peak_memory_bytes": result.predicted.predicted_peak_memory_bytes},
        "knobs": result.knobs,
        "explain": result.explain,
    }
