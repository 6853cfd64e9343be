"""DDP's bucketing rule: which gradients share an allreduce under a bucket cap (the knobs' names and defaults), shared
by the engine's search on runs (``dpro.engines.torch_ddp``) and on profiler traces (``.traces``)."""

from __future__ import annotations

from typing import Any

from dpro.sim.whatif import MB, Context

__all__ = ["BUCKET_CAP", "CAP_CANDIDATES_MB", "DEFAULT_BUCKET_CAP_MB", "FIND_UNUSED", "FIRST_BUCKET_CAP", "NAME",
           "POST_FORWARD", "bucket_groups", "ddp_buckets"]

NAME = "torch-ddp"
BUCKET_CAP, FIRST_BUCKET_CAP = "torch.ddp.bucket_cap_mb", "torch.ddp.first_bucket_cap_mb"
FIND_UNUSED = "torch.ddp.find_unused_parameters"
POST_FORWARD = "FW.ddp.post_forward"  # DDP's work after the model's forward, as the torch recorder names it
DEFAULT_BUCKET_CAP_MB = 25.0   # torch.nn.parallel.DistributedDataParallel's default
CAP_CANDIDATES_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64, 128, 256)


def ddp_buckets(gradients: list[tuple[str, int]], cap_mb: float, first_cap_mb: float | None = None) -> list[list[str]]:
    """Group gradients (in ready order) the way DDP does: fill a bucket until it reaches its cap."""
    limits = [first_cap_mb * MB] if first_cap_mb else []
    buckets: list[list[str]] = [[]]
    size = 0
    for name, nbytes in gradients:
        buckets[-1].append(name)
        size += nbytes
        limit = limits[0] if len(buckets) == 1 and limits else cap_mb * MB
        if size >= limit:
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


def bucket_groups(ctx: Context, knobs: dict[str, Any]) -> list[list[str]] | None:
    """DDP's buckets under ``knobs`` (merged over the run's); an explicit cap applies to the first bucket too."""
    if BUCKET_CAP not in knobs and FIRST_BUCKET_CAP not in knobs:
        return None
    merged = {**ctx.knobs, **knobs}
    cap = float(merged.get(BUCKET_CAP) or DEFAULT_BUCKET_CAP_MB)
    first = merged.get(FIRST_BUCKET_CAP)
    if BUCKET_CAP in knobs and FIRST_BUCKET_CAP not in knobs:
        first = None  # DDP's rule: a cap given explicitly applies to the first bucket too
    return ddp_buckets(ctx.gradients, cap, first)
