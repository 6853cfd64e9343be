"""``Profiler``: record a plain PyTorch training loop, with or without DDP."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import torch
from torch import nn

from dpro.errors import UsageError
from dpro.plugins.torch.recorder import TorchRecorder

__all__ = ["Profiler"]


class Profiler:
    """Record the steps ``steps`` of a training loop into a dpro run directory.

    Use it as a context manager around the loop and call ``step()`` once at the end of every
    iteration. Hooks are installed only while a profiled step runs; other steps run untouched.

    Args:
        model: the model, plain or wrapped in ``DistributedDataParallel``.
        optimizer: the optimizer (its ``step()`` is timed as UPDATE); None to skip UPDATE events.
        run_dir: the run directory to create; None makes ``./dpro-runs/<timestamp>`` (or under
            ``$DPRO_RUN_DIR``). An existing non-empty directory is refused: runs are never overwritten.
        steps: iterations to record, counted from 0 (default ``range(10, 20)``: skip warm-up).
        total_steps: the loop's length if known, so a window beyond it is refused at once.
        backward_marks: ``"gradients"`` (default: BW from the gradients' ready marks, modules without gradients of
            their own estimated) or ``"tensors"`` (a tensor hook per module: exact, costlier); see ``TorchRecorder``.

    Example:
        >>> with Profiler(ddp_model, opt, run_dir="runs/a", steps=range(5, 10)) as prof:  # doctest: +SKIP
        ...     for x, y in batches:
        ...         opt.zero_grad(); loss_fn(ddp_model(x), y).backward(); opt.step()
        ...         prof.step()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        run_dir: str | Path | None = None,
        steps: Iterable[int] = range(10, 20),
        *,
        total_steps: int | None = None,
        backward_marks: str = "gradients",
    ) -> None:
        self._recorder = TorchRecorder(model, optimizer, run_dir, steps, total_steps=total_steps,
                                       backward_marks=backward_marks)
        self._entered = False

    @property
    def run_dir(self) -> Path:
        """The run directory this profiler writes."""
        return self._recorder.run_dir

    def __enter__(self) -> Profiler:
        self._entered = True
        self._recorder.start()
        return self

    def step(self) -> None:
        """Mark the end of one training iteration."""
        if not self._entered:
            raise UsageError("Profiler.step() called outside `with Profiler(...) as prof:`")
        self._recorder.step()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        recorder = self._recorder
        recorder.close(error=exc)
        if exc is None and not recorder.started:
            raise UsageError(
                f"Profiler: steps {recorder.steps[0]}..{recorder.steps[-1]} were never reached; the loop "
                f"ended after {recorder.iteration} steps and nothing was recorded. Call prof.step() once per "
                f"iteration and choose steps inside the run."
            )
