"""``DproCallback``: record a Lightning ``Trainer`` run (``lightning.pytorch`` or ``pytorch_lightning``).

The callback subclasses the Callback class of every Lightning package that is installed, so one
class works with ``lightning.pytorch.Trainer`` and with ``pytorch_lightning.Trainer``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from dpro.plugins.torch.recorder import TorchRecorder
from dpro.record import check_window_fits, parse_steps


def _callback_bases() -> tuple[type, ...]:
    bases = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(package).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError("dpro.plugins.torch.lightning needs Lightning: pip install 'dpro[lightning]'")
    return tuple(bases)


def _lightning_versions() -> dict[str, str]:
    versions = {}
    for package in ("lightning", "pytorch_lightning"):
        try:
            versions[package] = importlib.import_module(package).__version__
        except ImportError:
            continue
    return versions


class DproCallback(*_callback_bases()):
    """Record steps ``steps`` (counted in training batches from 0) of ``Trainer.fit``.

    Args:
        run_dir: the run directory to create; None makes ``./dpro-runs/<timestamp>``.
        steps: training batches to record (default ``range(10, 20)``).

    Works with ``strategy="ddp"`` on CPU as on GPU: the DDP communication hook is registered on
    ``trainer.strategy.model`` when training starts (Lightning itself registers hooks on CUDA only).

    Example:
        >>> callback = DproCallback("runs/a", steps=range(5, 10))
        >>> trainer = Trainer(strategy="ddp", devices=2, callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(self, run_dir: str | Path | None = None, steps: Iterable[int] = range(10, 20)) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.steps = parse_steps(steps)
        self.recorder: TorchRecorder | None = None

    @staticmethod
    def _total_steps(trainer: Any) -> int | None:
        max_steps = getattr(trainer, "max_steps", -1)
        return max_steps if max_steps and max_steps > 0 else None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Refuse a window beyond ``max_steps`` before any training happens."""
        check_window_fits(self.steps, self._total_steps(trainer), "DproCallback")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Attach the recorder to the wrapped model and the optimizer; iteration 0 begins."""
        wrapped = trainer.strategy.model
        ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.recorder = TorchRecorder(
            pl_module, optimizer, self.run_dir, self.steps,
            total_steps=self._total_steps(trainer), ddp=ddp,
            extra_knobs={"lightning.strategy": type(trainer.strategy).__name__},
            versions=_lightning_versions(), who="DproCallback",
        )
        self.recorder.start()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """The batch is loaded: close the step's IO event."""
        if self.recorder is not None:
            self.recorder.batch_ready()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """One training batch (iteration) ended."""
        if self.recorder is not None:
            self.recorder.step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Write what was recorded, even if the run was shorter than the window."""
        if self.recorder is not None:
            self.recorder.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Keep the finished steps when training fails."""
        if self.recorder is not None:
            self.recorder.close(error=exception)
