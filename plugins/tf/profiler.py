"""``Profiler``: record a window of a custom TensorFlow training loop (``strategy.run`` in a ``tf.function``).

    with Profiler(model, run_dir="runs/x", steps=range(10, 20)) as prof:
        for batch in dist_dataset:
            train_step(batch)          # a tf.function calling strategy.run
            prof.step()

``prof.step()`` once per iteration, after the step's results are back (as with the torch Profiler). The
window's steps are timed from one ``step()`` to the next.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

from dpro.errors import UsageError
from dpro.plugins.tf.recorder import TFRecorder

__all__ = ["Profiler"]


class Profiler:
    """Records steps ``steps`` of a custom loop.

    Args:
        model: the Keras model trained (names the layers and gradients).
        run_dir: a new or empty directory, or None for ``dpro-runs/<timestamp>``.
        steps: the iterations to record, counted from 0.
        optimizer: the optimizer (default ``model.optimizer``): its name scope marks UPDATE ops.
        strategy: the ``tf.distribute`` strategy (default: the current one).
        total_steps: when known, a window beyond it is refused at once.
        batch_size: samples per step on this worker (per replica); with it the recompute search knows each
            layer's activation bytes.
    """

    def __init__(self, model: Any, run_dir: str | Path | None = None, steps: Any = range(10, 20), *,
                 optimizer: Any = None, strategy: Any = None, total_steps: int | None = None,
                 batch_size: int | None = None) -> None:
        self.recorder = TFRecorder(model, run_dir, steps, strategy=strategy, optimizer=optimizer,
                                   total_steps=total_steps, batch_size=batch_size)
        self.run_dir = self.recorder.run_dir

    def __enter__(self) -> Profiler:
        self.recorder.begin_step()
        return self

    def step(self) -> None:
        """Call once at the end of every iteration."""
        self.recorder.end_step()
        self.recorder.begin_step()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.recorder.close(error=exc)
        if exc is None and not self.recorder.started:
            steps = self.recorder.steps
            raise UsageError(f"dpro.plugins.tf.Profiler: steps {steps[0]}..{steps[-1]} were never reached; the loop "
                             f"ended after {self.recorder.iteration} steps. Call prof.step() once per iteration.")
