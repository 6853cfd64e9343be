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


def _search(ctx: Any, **options: Any) -> Any:
    from dpro.engines.horovod.search import search

    return search(ctx, **options)


ENGINE = Engine(
    name=NAME,
    doc="Horovod (PyTorch, Gloo/MPI): tensors fused by Horovod's background loop, one allreduce per buffer",
    optimize=_search,
    prepare_run=_prepare_run,
    apply="environment (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME) set by dpro-launch --apply; tensor_groups as "
          "hvd.DistributedOptimizer(groups=) by dpro-launch's auto-attach",
)
