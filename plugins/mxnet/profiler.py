"""``Profiler``: record a window of a Gluon training loop.

    with Profiler(net, trainer, run_dir="runs/x", steps=range(10, 20)) as prof:
        for x, y in batches:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(batch_size)
            prof.step()

``prof.step()`` once per iteration, after ``trainer.step`` (as with the torch Profiler). Hooks are installed for
the window only; the other steps run untouched. Once the window's last step is marked, the compile probe times the
net imperative against hybridized on its last batch (``dpro.plugins.mxnet.probes``; ``$DPRO_PROBE_COMPILE=0`` or
``$DPRO_PROBES=0`` turn it off).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

from dpro.errors import UsageError
from dpro.plugins.mxnet.recorder import GluonRecorder

__all__ = ["Profiler"]


class Profiler:
    """Records steps ``steps`` of a Gluon loop into a dpro run directory.

    Args:
        net: the ``gluon.Block`` trained (its blocks name the ops).
        trainer: the ``gluon.Trainer`` stepping it; its kvstore decides the engine (``dist_*``: ``mxnet-ps``).
        run_dir: a new or empty directory, or None for ``dpro-runs/<timestamp>``; worker 0 decides, when the window
            starts (a ``dist`` kvstore numbers its workers only once it runs).
        steps: the iterations to record, counted from 0 (default ``range(10, 20)``: skip warm-up).
        total_steps: when known, a window beyond it is refused at once.
        batch_size: samples per step on this worker (kept in run.json).
    """

    def __init__(self, net: Any, trainer: Any, run_dir: str | Path | None = None, steps: Any = range(10, 20), *,
                 total_steps: int | None = None, batch_size: int | None = None) -> None:
        self.recorder = GluonRecorder(net, trainer, run_dir, steps, total_steps=total_steps, batch_size=batch_size)
        self._entered = False

    @property
    def run_dir(self) -> Path | None:
        """The run directory, once the window has started (None before)."""
        return self.recorder.run_dir

    def __enter__(self) -> Profiler:
        self._entered = True
        self.recorder.begin_step()
        return self

    def step(self) -> None:
        """Mark the end of one training iteration."""
        if not self._entered:
            raise UsageError("Profiler.step() called outside `with Profiler(...) as prof:`")
        self.recorder.end_step()
        self.recorder.begin_step()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.recorder.close(error=exc)
        if exc is None and not self.recorder.started:
            steps = self.recorder.steps
            raise UsageError(f"dpro.plugins.mxnet.Profiler: steps {steps[0]}..{steps[-1]} were never reached; the "
                             f"loop ended after {self.recorder.iteration} steps. Call prof.step() once per iteration.")
