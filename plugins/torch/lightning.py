"""``DproCallback``: record a Lightning ``Trainer`` run (``lightning.pytorch`` or ``pytorch_lightning``);
``DproProfiler``: the same in Lightning's profiler slot, ``Trainer(profiler=DproProfiler(...))``, whose
``summary()`` (the report Lightning prints when ``fit`` ends) is dpro's short analysis of the run.

Both subclass the base class of every Lightning package that is installed, so one class works with
``lightning.pytorch.Trainer`` and with ``pytorch_lightning.Trainer``. The profiler records through a
``DproCallback`` it adds to the trainer's callbacks when Lightning sets the profiler up (before any
callback hook runs), so there is one recorder lifecycle.

Given a dpro config (``config=`` or ``$DPRO_CONFIG``), the callback also applies it: in ``setup``,
before the strategy wraps the LightningModule in DDP, it recomputes the config's modules and puts
the bucket sizes into the DDP strategy's arguments; in ``on_train_start`` it registers gradient
compression if the config asks for it. Modules that a LightningModule creates in
``configure_model`` do not exist yet in ``setup`` (Lightning calls it afterwards), so such a model's
fingerprint does not match and its config is refused.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dpro.analyze import analyze_run
from dpro.config import DPRO_CONFIG, Config
from dpro.engines import load_prepared
from dpro.errors import ConfigError, DproError
from dpro.logs import get_logger
from dpro.plugins.torch.apply import (
    apply,
    ddp_kwargs,
    load_config,
    micro_batch_loader,
    micro_batch_rows,
    micro_batches_change,
    recomputed,
    register_compression,
)
from dpro.plugins.torch.recorder import TorchRecorder
from dpro.record.protocol import check_window_fits, parse_steps
from dpro.report.text import format_summary

__all__ = ["DproCallback", "DproProfiler"]


def _lightning_bases(module: str, name: str) -> tuple[type, ...]:
    """``<package>.<module>.<name>`` of every Lightning package installed (``lightning.pytorch``,
    ``pytorch_lightning``)."""
    bases = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(getattr(importlib.import_module(f"{package}{module}"), name))
        except ImportError:
            continue
    if not bases:
        raise ImportError("dpro.plugins.torch.lightning needs Lightning: pip install 'dpro[lightning]'")
    return tuple(bases)


def _callback_bases() -> tuple[type, ...]:
    return _lightning_bases("", "Callback")


def _lightning_versions() -> dict[str, str]:
    versions = {}
    for package in ("lightning", "pytorch_lightning"):
        try:
            versions[package] = importlib.import_module(package).__version__
        except ImportError:
            continue
    return versions


def _apply_micro_batches(trainer: Any, pl_module: Any, k: int, source: str) -> None:
    """A config's ``micro_batches`` in Lightning's own terms: ``accumulate_grad_batches`` k, and the training
    DataLoader's batches of the rows that split an optimizer step's samples into ``k`` (``micro_batch_rows``,
    ``micro_batch_loader``); Lightning skips DDP's allreduce on all but the last. Said, not applied, where the module
    steps its optimizer itself (manual optimization) or the loader cannot be resized.

    Raises:
        ConfigError: the step's samples do not split into ``k`` (``micro_batch_rows``).
    """
    def say(text: str) -> None:
        if trainer.global_rank == 0:
            print(f"dpro: {source}: {text}", file=sys.stderr, flush=True)

    accumulation = trainer.accumulate_grad_batches
    if not isinstance(accumulation, int):  # a schedule of its own (older Lightning): dpro does not rewrite it
        say(f"micro_batches={k} not applied: accumulate_grad_batches is {type(accumulation).__name__}, not a number")
        return
    if k == accumulation:
        return
    if not getattr(pl_module, "automatic_optimization", True):
        say(f"micro_batches={k} not applied: the module steps its optimizer itself (manual optimization); "
            f"{micro_batches_change(k)}")
        return
    data = getattr(trainer.fit_loop, "_data_source", None)  # where Trainer.fit takes its training batches
    instance = getattr(data, "instance", None)
    if isinstance(instance, DataLoader):
        rows = micro_batch_rows(instance.batch_size, accumulation, k, source)
        batch = f"batch_size {instance.batch_size} -> {rows}, "
        data.instance = micro_batch_loader(instance, rows, source)
    elif instance is not None and callable(getattr(instance, "train_dataloader", None)):
        made = instance.train_dataloader  # the module's or datamodule's hook, resized when called

        def train_dataloader() -> Any:
            got = made()
            if not isinstance(got, DataLoader):
                return got
            return micro_batch_loader(got, micro_batch_rows(got.batch_size, accumulation, k, source), source)

        instance.train_dataloader = train_dataloader
        batch = "batches resized, "
    else:
        say(f"micro_batches={k} not applied: the training batches do not come from a DataLoader dpro can resize")
        return
    trainer.accumulate_grad_batches = k
    say(f"micro_batches={k}: {batch}accumulate_grad_batches {accumulation} -> {k}")


class DproCallback(*_callback_bases()):
    """Record steps ``steps`` (optimizer steps counted from 0, Lightning's ``global_step``) of ``Trainer.fit``.

    Args:
        run_dir: the run directory to create; None makes ``./dpro-runs/<timestamp>``.
        steps: optimizer steps to record (default ``range(10, 20)``); one step is one training batch, or
            ``accumulate_grad_batches`` batches when gradients are accumulated.
        config: a dpro config.json to apply (default ``$DPRO_CONFIG``; None and unset: apply nothing).
            Its recompute modules are wrapped and its bucket sizes passed to DDP in ``setup``, before
            the strategy wraps the model, and its micro-batches become ``accumulate_grad_batches`` over a
            DataLoader resized to split each step's samples into them; a config made for another job raises
            ``ConfigError``.
        force: apply a config made for another job anyway (a warning lists what differs).
        backward_marks: ``"gradients"`` (default) or ``"tensors"``: how BW is timed (see ``TorchRecorder``).

    Works with ``strategy="ddp"`` on CPU as on GPU: the DDP communication hook is registered on
    ``trainer.strategy.model`` when training starts (Lightning itself registers hooks on CUDA only).

    Example:
        >>> callback = DproCallback("runs/a", steps=range(5, 10))
        >>> trainer = Trainer(strategy="ddp", devices=2, callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(
        self, run_dir: str | Path | None = None, steps: Iterable[int] = range(10, 20), *,
        config: str | Path | None = None, force: bool = False, backward_marks: str = "gradients",
    ) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.steps = parse_steps(steps)
        self.config_path = config if config is not None else (os.environ.get(DPRO_CONFIG) or None)
        self.force = force
        self.backward_marks = backward_marks
        self.config: Config | None = None
        self.recorder: TorchRecorder | None = None
        self._global_step = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Apply the config before the strategy wraps the model: recompute, then the DDP bucket sizes."""
        if self.config_path is None or stage != "fit":
            return
        self.config = load_config(self.config_path, model=pl_module, world_size=trainer.world_size,
                                  force=self.force)
        apply(pl_module, self.config)
        if self.config.knobs.get("micro_batches") is not None:
            _apply_micro_batches(trainer, pl_module, int(self.config.knobs["micro_batches"]), self.config.source)
        kwargs = ddp_kwargs(self.config, model=pl_module)
        if not kwargs:
            return
        strategy = trainer.strategy
        ddp_args = getattr(strategy, "_ddp_kwargs", None)  # DDPStrategy passes these to DistributedDataParallel
        if not isinstance(ddp_args, dict):
            raise ConfigError(self.config.source, f"DproCallback: the config sets DDP bucket sizes but the "
                              f"strategy {type(strategy).__name__} does not wrap the model in DistributedDataParallel;"
                              f" use strategy='ddp' or a config made for this strategy", "knobs")
        overridden = sorted(k for k in ("bucket_cap_mb", "bucket_cap_mb_list") if k in ddp_args
                            and ddp_args[k] != kwargs.get(k))
        if overridden and trainer.global_rank == 0:
            get_logger("dpro.plugins.torch").info("DproCallback: %s overrides the strategy's %s", self.config.source,
                                                  ", ".join(overridden))
        for k in ("bucket_cap_mb", "bucket_cap_mb_list"):
            ddp_args.pop(k, None)
        ddp_args.update(kwargs)

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
        extra_knobs: dict[str, Any] = {"lightning.strategy": type(trainer.strategy).__name__}
        if self.config is not None:
            if self.config.knobs.get("gradient_compression") and ddp is None:
                raise ConfigError(self.config.source, f"DproCallback: the config asks for gradient compression but "
                                  f"the strategy {type(trainer.strategy).__name__} has no DDP model",
                                  'knobs["gradient_compression"]')
            if ddp is not None:
                register_compression(ddp, self.config)  # before the recorder's COMM hook: DDP takes one
            extra_knobs.update({"dpro.config": self.config.source, "recompute": recomputed(pl_module)})
        self.recorder = TorchRecorder(
            pl_module, optimizer, self.run_dir, self.steps,
            total_steps=self._total_steps(trainer), ddp=ddp, extra_knobs=extra_knobs,
            versions=_lightning_versions(), who="DproCallback", backward_marks=self.backward_marks,
        )
        self._global_step = trainer.global_step
        self.recorder.start()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """The batch is loaded: close the step's IO event."""
        if self.recorder is not None:
            self.recorder.batch_ready()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """A training batch ended; it ends an iteration when an optimizer stepped during it (with
        ``accumulate_grad_batches=k`` an iteration is k batches: their forwards and backwards, one update)."""
        if self.recorder is None or trainer.global_step == self._global_step:
            return
        self._global_step = trainer.global_step
        self.recorder.step()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Validation inside the window is not training: its forwards are not recorded (a gap of the step)."""
        if self.recorder is not None:
            self.recorder.suspend()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Training resumes: record again."""
        if self.recorder is not None:
            self.recorder.resume()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Write what was recorded, even if the run was shorter than the window."""
        if self.recorder is not None:
            self.recorder.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Keep the finished steps when training fails."""
        if self.recorder is not None:
            self.recorder.close(error=exception)


class DproProfiler(*_lightning_bases(".profilers", "Profiler")):
    """Lightning's profiler slot: record steps ``steps`` of ``Trainer.fit`` on every rank with dpro.

    Args:
        dirpath: where the run directory goes, ``<dirpath>/<filename or "dpro">`` (the run directory itself when
            ``run_dir`` is given); None: ``./dpro-runs/<timestamp>``. Lightning writes the summary beside it when
            ``filename`` is given (``<dirpath>/fit-<filename>.txt``), else logs it.
        filename: the run directory's and the summary file's name.
        steps, run_dir, config, force, backward_marks: as ``DproCallback``'s.

    ``summary()`` waits for every rank's files (a barrier: Lightning calls it on every rank when ``fit`` ends) and
    returns, on rank 0, dpro's short analysis of the run (``dpro.report.text.format_summary``), elsewhere "".

    Example:
        >>> trainer = Trainer(strategy="ddp", devices=2,
        ...                   profiler=DproProfiler(dirpath="runs", steps=range(5, 10)))  # doctest: +SKIP
    """

    def __init__(
        self, dirpath: str | Path | None = None, filename: str | None = None, steps: Iterable[int] = range(10, 20),
        *, run_dir: str | Path | None = None, config: str | Path | None = None, force: bool = False,
        backward_marks: str = "gradients",
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        if run_dir is None and dirpath is not None:
            run_dir = Path(dirpath) / (filename or "dpro")
        self.callback = DproCallback(run_dir, steps, config=config, force=force, backward_marks=backward_marks)
        self._summary: str | None = None

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Join the trainer's callbacks before their first hook (Lightning sets the profiler up just before)."""
        super().setup(stage, local_rank, log_dir)
        module = getattr(self, "_lightning_module", None)
        trainer = getattr(module, "trainer", None) if module is not None else None
        if stage == "fit" and trainer is not None and self.callback not in trainer.callbacks:
            trainer.callbacks.append(self.callback)

    def start(self, action_name: str) -> None:
        """Lightning's actions are not timed: the callback's hooks time the step's parts."""

    def stop(self, action_name: str) -> None:
        """See ``start``."""

    def summary(self) -> str:
        """dpro's short analysis of the recorded run on rank 0 (once every rank has written its files), else ""."""
        if self._summary is not None:
            return self._summary
        recorder = self.callback.recorder
        if recorder is None or recorder.run_dir is None:
            self._summary = ""
            return self._summary
        recorder.transport.barrier()  # every rank's rank-<r>.json is written
        self._summary = ""
        if recorder.rank == 0:
            try:
                self._summary = format_summary(analyze_run(load_prepared(recorder.run_dir)).analysis)
            except DproError as err:
                self._summary = f"dpro: the run in {recorder.run_dir} could not be analyzed: {err}"
        return self._summary
