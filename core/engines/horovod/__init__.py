"""The ``horovod`` engine: Horovod's ``DistributedOptimizer`` (PyTorch), allreduces fused by Horovod's background
loop. Its traces: ``timeline`` (HOROVOD_TIMELINE, merged into the run at load time as one COMM per fused buffer);
its search: ``search`` (fusion threshold and cycle time by replay, written as the config's ``env`` knobs)."""

from __future__ import annotations

from typing import Any

from dpro.engines.base import Engine

__all__ = ["ENGINE", "NAME"]

NAME = "horovod"


def _prepare_run(run: Any) -> None:
    """Merge ``horovod-timeline.json`` (fused buffers) into the run when it holds one."""
    from dpro.engines.horovod.timeline import find_timeline, merge_horovod_timeline

    path = find_timeline(run)
    if path is not None:
        merge_horovod_timeline(run, path)


def _notes(run: Any) -> list[str]:
    merged = ((run.meta or {}).get("horovod") or {}).get("merged") or {}
    if merged.get("distinct_fusions", 0) > 1:
        return [f"Horovod fused the gradients {merged['distinct_fusions']} different ways in "
                f"{len(merged.get('steps', []))} steps (fusion depends on timing); every step is used: each tensor's "
                "allreduce ends with its fused buffer, and transfers are calibrated from median end times in the step"]
    return []


def _search(ctx: Any, **options: Any) -> Any:
    from dpro.engines.horovod.search import search

    return search(ctx, **options)


ENGINE = Engine(
    name=NAME,
    doc="Horovod (PyTorch, Gloo/MPI): tensors fused by Horovod's background loop, one allreduce per buffer",
    optimize=_search,
    prepare_run=_prepare_run,
    notes=_notes,
    apply="environment (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME) set by dpro-launch --apply; tensor_groups as "
          "hvd.DistributedOptimizer(groups=) by dpro-launch's auto-attach",
)
