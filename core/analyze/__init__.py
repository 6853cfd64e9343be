"""Stage 7, analysis: a run directory's (``run``: align, build the DAG, replay, the prediction error, where the step
goes, stragglers) and PyTorch profiler traces' (``traces``: replay, held-out prediction, what-ifs)."""

from dpro.analyze import run, traces
from dpro.analyze.run import *  # noqa: F403 - the package is its modules' public face
from dpro.analyze.traces import *  # noqa: F403

__all__ = [*run.__all__, *traces.__all__]
