"""Stage 6, optimize: search knob settings, each candidate priced by replay (``search``); each engine's own
search lives in its engine module (``dpro.engines``)."""

from dpro.optimize.search import (
    MIN_GAIN,
    OptimizeResult,
    RecomputeChoice,
    best_grouping,
    best_recompute,
    config_document,
    gradient_ready_us,
    optimize,
    optimize_common,
    recompute_candidates,
)

__all__ = [
    "MIN_GAIN",
    "OptimizeResult",
    "RecomputeChoice",
    "best_grouping",
    "best_recompute",
    "config_document",
    "gradient_ready_us",
    "optimize",
    "optimize_common",
    "recompute_candidates",
]
