"""``DproTrainerCallback``: record a Hugging Face ``transformers.Trainer`` job from a callback, for users who prefer one
to ``dpro-launch`` (which records a Trainer script unmodified).

    from dpro.plugins.torch.transformers_callback import DproTrainerCallback
    Trainer(..., callbacks=[DproTrainerCallback(run_dir="runs/a", steps=range(10, 20))]).train()

One optimizer step (``on_step_end``, after gradient accumulation) is one iteration. The Trainer builds its
``DistributedDataParallel`` wrapper before training begins and hands callbacks the model inside it, so the wrapper is
found among the live objects (the ``DistributedDataParallel`` whose module is that model); a job on one process is
recorded without it. The recorder is the same as the ``Profiler``'s (``TorchRecorder``). ``transformers`` is imported
only by this module.

``accumulate`` applies a config's ``micro_batches`` through the Trainer's own accumulation (dpro-launch's
auto-attach calls it before the Trainer is built; a script can call it on its ``TrainingArguments``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from dpro.errors import DproError
from dpro.logs import get_logger
from dpro.plugins.torch.apply import micro_batch_rows
from dpro.plugins.torch.recorder import TorchRecorder, active_recorders

__all__ = ["DproTrainerCallback", "accumulate", "ddp_wrapping"]

logger = get_logger("dpro.plugins.torch.transformers_callback")
WHO = "DproTrainerCallback"


def ddp_wrapping(model: nn.Module) -> DistributedDataParallel | None:
    """The live ``DistributedDataParallel`` that wraps ``model`` (or a compiled ``model``), or None."""
    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel):  # type(): no object's __class__ is asked
            inner = obj.module
            if inner is model or getattr(inner, "_orig_mod", None) is model:
                return obj
    return None


def accumulate(training_args: Any, k: int, source: str = "accumulate") -> None:
    """The samples of an optimizer step as ``k`` micro-batches: ``gradient_accumulation_steps`` k and the
    per-device batch that many rows (``apply.micro_batch_rows``; the Trainer skips the allreduce of all but the last,
    as DDP's ``no_sync``). Call it before the ``Trainer`` is built (its accelerator reads the accumulation steps then).

    Raises:
        ConfigError: the step's samples do not split into ``k`` equal micro-batches.
    """
    training_args.per_device_train_batch_size = micro_batch_rows(
        int(training_args.per_device_train_batch_size), int(training_args.gradient_accumulation_steps), k, source)
    training_args.gradient_accumulation_steps = k


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose step hooks fire: Accelerate's wrapper steps the one it holds."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


class DproTrainerCallback(TrainerCallback):
    """Record iterations ``steps`` (optimizer steps, from 0) of a ``Trainer`` job into ``run_dir``.

    Args:
        run_dir: the run directory to create (None: ``./dpro-runs/<timestamp>`` or under ``$DPRO_RUN_DIR``).
        steps: the optimizer steps to record (default ``range(10, 20)``).
        backward_marks: as the ``Profiler``'s (``"gradients"`` or ``"tensors"``).
    """

    def __init__(self, run_dir: str | Path | None = None, steps: Iterable[int] = range(10, 20), *,
                 backward_marks: str = "gradients") -> None:
        self.run_dir, self.steps, self.backward_marks = run_dir, list(steps), backward_marks
        self.recorder: TorchRecorder | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if model is None or self.recorder is not None:
            return
        if active_recorders():
            logger.info("%s: another dpro recorder is active in this process; this callback records nothing", WHO)
            return
        wrapped = ddp_wrapping(model) or model
        total = int(getattr(args, "max_steps", 0) or 0) or None
        try:
            self.recorder = TorchRecorder(wrapped, _torch_optimizer(optimizer), self.run_dir, self.steps,
                                          total_steps=total, who=WHO, backward_marks=self.backward_marks)
        except DproError as err:
            logger.warning("%s: not recording: %s", WHO, err)
            return
        self.recorder.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()

    @property
    def recorded_run(self) -> Path | None:
        """The run directory, once recording began."""
        return self.recorder.run_dir if self.recorder is not None and self.recorder.started else None
