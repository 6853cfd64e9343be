"""Record Horovod (PyTorch) jobs: ``record_horovod(model, optimizer, run_dir, steps)``.

The module, gradient-ready and optimizer hooks are ``TorchRecorder``'s; this module adds what is
Horovod's own:

- the process group is Horovod's (``hvd.rank()``, ``hvd.size()``); the run directory name, the host
  names, the clock exchange and the allreduce probe go over Horovod collectives (broadcast,
  allgather, allreduce), so the job needs no ``torch.distributed`` process group;
- per-tensor allreduce timing on ``hvd.DistributedOptimizer``: the optimizer's
  ``_allreduce_grad_async`` (and ``_grouped_allreduce_grad_async`` with ``groups=``) is wrapped so that
  each launch is marked, and the handle is polled (``hvd.poll``) at every later launch and, in
  ``synchronize()``, until it completes. Each tensor gives a ``COMM.<tensor>.allreduce`` event (launch
  to completion seen by the poll) with ``bytes`` and ``tensors``;
- ``UPDATE.optimizer`` is the optimizer's own work after ``synchronize()`` (torch's step hooks fire
  twice under Horovod, once for the wrapper class and once for the wrapped optimizer's ``step``);
- run.json: engine ``horovod``, the knobs ``HOROVOD_FUSION_THRESHOLD`` (bytes) and
  ``HOROVOD_CYCLE_TIME`` (ms) from the environment or Horovod 0.28.1's defaults (128 MiB, 1 ms; the
  values in ``horovod/common/operations.cc``), and a ``horovod`` section (timeline path, the wall/
  monotonic clock pair used to place the timeline, Horovod's tensor names, explicit groups).

Horovod fuses the tensors ready in one cycle into one buffer, so the per-tensor events overlap; the
transfers Horovod really made come from its timeline. Horovod opens ``HOROVOD_TIMELINE`` in
``hvd.init()`` (rank 0 only), before any recorder exists, so the job's environment must name it:

- ``HOROVOD_TIMELINE=<run_dir>/horovod-timeline.json`` (the launcher chooses the run directory up
  front). The recorder accepts a run directory that holds only that file.
- ``HOROVOD_TIMELINE=DYNAMIC``: the recorder starts the timeline into ``<run_dir>/horovod-timeline.json``
  when the profiled window begins (``hvd.start_timeline``) and stops it when recording ends.
- any other path: recorded in run.json; ``dpro.engines.prepared`` reads it from there if it still exists.

``dpro.engines.prepared`` (after ``load_run``, which only reads) merges the timeline when it finds it
(``dpro.engines.horovod.timeline``): each per-tensor event ends when its fused buffer ended (the poll sees
completions late) and names its buffer, with Horovod's phases.

Example (run with ``horovodrun -np 2 -H localhost:2 --gloo python train.py``)::

    hvd.init()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    with record_horovod(model, opt, run_dir="runs/hvd", steps=range(5, 15)) as rec:
        for x, y in batches:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
            rec.step()
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import horovod
import horovod.torch as hvd
import numpy as np
import torch
from torch import nn

from dpro.engines.horovod.knobs import DEFAULT_CYCLE_TIME_MS, DEFAULT_FUSION_THRESHOLD, knobs_from_environment
from dpro.engines.horovod.knobs import NAME as ENGINE
from dpro.engines.horovod.timeline import TIMELINE_FILE
from dpro.errors import UsageError
from dpro.plugins.torch.recorder import COMM, COMPUTE, MECHANISMS, TorchRecorder, timed_closure
from dpro.record.collective_transport import CollectiveTransport
from dpro.record.protocol import Clock, claim_run_dir, last_block_start

__all__ = ["DEFAULT_CYCLE_TIME_MS", "DEFAULT_FUSION_THRESHOLD", "TIMELINE_FILE", "HorovodRecorder",
           "horovod_knobs", "record_horovod"]



def horovod_knobs(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The Horovod knobs in force: from the environment, else Horovod's defaults."""
    return knobs_from_environment(dict(os.environ if environ is None else environ))


class HorovodCollectives:
    """``horovod.torch``'s collectives as ``dpro.record.collective_transport.Collectives`` (numpy in and out)."""

    def __init__(self) -> None:
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.backend = "gloo" if hvd.gloo_enabled() else ("mpi" if hvd.mpi_enabled() else "horovod")

    def broadcast(self, data: np.ndarray, root: int, name: str) -> np.ndarray:
        return hvd.broadcast(torch.from_numpy(np.ascontiguousarray(data)), root_rank=root, name=name).numpy()

    def allgather(self, data: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(torch.from_numpy(np.ascontiguousarray(data)), name=name).numpy()

    def barrier(self) -> None:
        hvd.barrier()

    def allreduce(self, nbytes: int, name: str) -> None:
        hvd.allreduce(torch.zeros(max(1, nbytes // 4), dtype=torch.float32), op=hvd.Sum, name=name)

    def allreduce_during(self, nbytes: int, name: str, compute: Callable[[], None],
                         clock: Clock) -> tuple[float, float]:
        handle = hvd.allreduce_async(torch.zeros(max(1, nbytes // 4), dtype=torch.float32), op=hvd.Sum, name=name)
        t0 = clock.now()
        compute()
        t1 = clock.now()
        hvd.synchronize(handle)
        return t1 - t0, clock.now() - t1


    def allreduce_under(self, nbytes: int, name: str, compute: Callable[[], None] | None, clock: Clock) -> float:
        handle = hvd.allreduce_async(torch.zeros(max(1, nbytes // 4), dtype=torch.float32), op=hvd.Sum, name=name)
        t0 = clock.now()
        if compute is not None:
            while not hvd.poll(handle):
                compute()
        hvd.synchronize(handle)
        return clock.now() - t0


def _claim_beside_timeline(run_dir: str | Path | None) -> Path:
    """``claim_run_dir``, except that a directory holding only the timeline Horovod opened in ``hvd.init()``
    (``HOROVOD_TIMELINE=<run_dir>/horovod-timeline.json``) counts as empty."""
    if run_dir is not None:
        path = Path(run_dir)
        timeline = os.environ.get("HOROVOD_TIMELINE", "")
        if path.is_dir() and timeline and Path(timeline).resolve().parent == path.resolve():
            others = [p for p in path.iterdir() if p.resolve() != Path(timeline).resolve()]
            if not others:
                return path
    return claim_run_dir(run_dir)


class HorovodRecorder(TorchRecorder):
    """``TorchRecorder`` on Horovod's process group, timing ``hvd.DistributedOptimizer``'s allreduces."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, run_dir: str | Path | None,
                 steps: Iterable[int], *, total_steps: int | None = None, extra_knobs: dict[str, Any] | None = None,
                 who: str = "dpro.plugins.torch.horovod.record_horovod", backward_marks: str = "gradients",
                 mechanisms: Iterable[str] = MECHANISMS) -> None:
        if not hvd.is_initialized():
            raise UsageError(f"{who}: Horovod is not initialized; call hvd.init() before recording")
        if not hasattr(optimizer, "_allreduce_grad_async") or not hasattr(optimizer, "synchronize"):
            raise UsageError(f"{who}: optimizer must be the hvd.DistributedOptimizer of the job, got "
                             f"{type(optimizer).__name__}")
        self.hvd_optimizer = optimizer
        extra = {**horovod_knobs(), "optimizer": type(optimizer).__name__,
                 "horovod.groups": _groups_knob(optimizer), **(extra_knobs or {})}
        # optimizer=None: TorchRecorder's UPDATE hooks would fire twice under Horovod (see _install_hooks)
        super().__init__(model, None, run_dir, steps, total_steps=total_steps, extra_knobs=extra,
                         versions={"horovod": horovod.__version__}, engine=ENGINE, who=who,
                         transport=CollectiveTransport(HorovodCollectives()), claim=_claim_beside_timeline,
                         backward_marks=backward_marks,
                         mechanisms=mechanisms, probes=False)  # a probe's backward would fire Horovod's allreduces
        self._pending: dict[Any, tuple[str, str, list[str], int, Any, int, dict]] = {}
        self._update_start: Any = None
        self._update_open = False
        self._timeline_started = False
        self._hvd_names = dict(getattr(optimizer, "_parameter_names", {}))  # param -> Horovod's name
        self._wrap_optimizer()
        if os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC":
            # Horovod enables a DYNAMIC timeline's per-cycle coordination in hvd.init() (operations.cc), with no
            # file open, until the first stop: stopped here, the steps before the window run as unrecorded ones
            with contextlib.suppress(ValueError):
                hvd.stop_timeline()

    def _run_extra(self) -> dict[str, Any]:
        timeline = os.environ.get("HOROVOD_TIMELINE", "")
        wall_us, rank_us = time.time_ns() / 1000.0, self.clock.now()
        names = {hvd_name: self._param_name.get(id(p), hvd_name) for p, hvd_name in self._hvd_names.items()}
        return {"horovod": {
            "version": horovod.__version__,
            "timeline": timeline or None,
            "timeline_file": TIMELINE_FILE,
            "note": "HOROVOD_TIMELINE is written by rank 0 only; its ts count µs from hvd.init() on "
                    "CLOCK_MONOTONIC, placed on rank 0's clock with the wall/rank clock pair below",
            "clock": {"wall_us": wall_us, "rank_us": rank_us},
            "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),  # ranks per host, hosts (Horovod's view)
            "tensor_names": {k: v for k, v in names.items() if k != v},
            "groups": [[self._name_of(p) for p in group] for group in _explicit_groups(self.hvd_optimizer)],
        }}

    # ---- the optimizer's allreduces ----------------------------------------------------------------

    def _name_of(self, p: torch.Tensor) -> str:
        return self._param_name.get(id(p), self._hvd_names.get(p, "?"))

    def _wrap_optimizer(self) -> None:
        opt = self.hvd_optimizer
        single, grouped, sync = opt._allreduce_grad_async, getattr(opt, "_grouped_allreduce_grad_async", None), \
            opt.synchronize

        timed = "comm" in self.mechanisms  # else no launch marks and no polling: the timeline alone has COMM

        def allreduce_grad_async(p: torch.Tensor) -> Any:
            if not self._recording or not timed:
                return single(p)
            start = self._mark()
            out = single(p)
            self._launched(out[0], [p], start)
            return out

        def grouped_allreduce_grad_async(ps: Any) -> Any:
            if not self._recording or not timed:
                return grouped(ps)
            start = self._mark()
            out = grouped(ps)
            self._launched(out[0], list(ps), start)
            return out

        def synchronize() -> Any:
            if not self._recording:
                return sync()
            self._poll(until_done=True)
            result = sync()
            self._update_start = self._mark()
            return result

        opt._allreduce_grad_async = allreduce_grad_async
        if grouped is not None:
            opt._grouped_allreduce_grad_async = grouped_allreduce_grad_async
        opt.synchronize = synchronize
        self._wrapped = ("_allreduce_grad_async", "_grouped_allreduce_grad_async", "synchronize")

    def _unwrap_optimizer(self) -> None:
        opt = getattr(self, "hvd_optimizer", None)
        if opt is None:
            return
        for attr in self._wrapped:
            opt.__dict__.pop(attr, None)  # the class's methods show through again
        self.hvd_optimizer = None

    def _launched(self, handle: Any, params: list[torch.Tensor], start: Any) -> None:
        self._poll(until_done=False)
        if handle is None or callable(handle):  # sparse / unusual paths: not timed
            return
        names = [self._name_of(p) for p in params]
        nbytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        hvd_name = self._hvd_names.get(params[0], names[0])
        self._pending[handle] = (names[0], hvd_name, names, nbytes, start, self._iteration, {})

    def _poll(self, *, until_done: bool) -> None:
        """Mark the completion of every launched allreduce that has finished (all of them if ``until_done``).

        Waiting polls and yields the CPU between polls: sleeping a millisecond between polls, as Horovod's own
        ``WaitAndClear`` does, keeps the recorded steps further from the unrecorded job (docs/measurements.md)."""
        while self._pending:
            for handle in list(self._pending):
                if hvd.poll(handle):
                    self._completed(handle, self._mark())
            if not until_done or not self._pending:
                return
            os.sched_yield()

    def _completed(self, handle: Any, end: Any) -> None:
        first, hvd_name, names, nbytes, start, step, _ = self._pending.pop(handle)
        if self._log is None or step != self._iteration:
            return
        args = {"step": step, "bytes": nbytes, "tensors": names, "op": "allreduce", "phase": "allreduce",
                "hvd_name": hvd_name, "source": "launch to completion seen by hvd.poll (before fusion)"}
        self._log.ops.append((f"COMM.{first}.allreduce", "COMM", COMM, start, end, args))

    # ---- UPDATE ----------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        super()._install_hooks()
        opt = self.hvd_optimizer
        self._handles += [opt.register_step_pre_hook(self._hvd_update_pre),
                          opt.register_step_post_hook(self._hvd_update_post)]

    def _hvd_update_pre(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[tuple, dict] | None:
        # fires for the wrapper's step (before synchronize) and again for the wrapped optimizer's step
        self._update_start = self._mark()
        self._update_open = True
        return timed_closure(args, kwargs, self._closure_ended)

    def _hvd_update_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._update_open:
            return  # the wrapper's post hook, after the inner one was recorded
        self._update_open = False
        self._log.ops.append(("UPDATE.optimizer", "UPDATE", COMPUTE, self._update_start, self._mark(),
                              {"step": self._iteration, "optimizer": type(optimizer).__name__}))

    # ---- window ------------------------------------------------------------------------------------

    def _block_started(self) -> None:
        """With ``HOROVOD_TIMELINE=DYNAMIC`` (``dpro-launch --horovod-timeline``), Horovod's timeline runs in the
        window's last block only. Once started, the timeline slows every later step of the job, stopped or not
        (bench/horovod_overhead.py): the earlier blocks and the gaps run as the job does without it, and the
        step model is built from them; the last block gives the fused buffers that price Horovod's knobs."""
        if os.environ.get("HOROVOD_TIMELINE") != "DYNAMIC" or self._iteration != last_block_start(self.steps):
            return
        hvd.start_timeline(str(self.run_dir / TIMELINE_FILE))
        self._timeline_started = True

    def _block_ended(self) -> None:
        self._stop_timeline()

    def _stop_timeline(self) -> None:
        if self._timeline_started:
            self._timeline_started = False
            with contextlib.suppress(ValueError):
                hvd.stop_timeline()

    def close(self, error: BaseException | None = None) -> Path | None:
        self._stop_timeline()
        self._pending.clear()
        self._unwrap_optimizer()
        return super().close(error)

    # ---- context manager (the Profiler protocol) ---------------------------------------------------

    def __enter__(self) -> HorovodRecorder:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(error=exc)
        if exc is None and not self.started:
            raise UsageError(f"{self.who}: steps {self.steps[0]}..{self.steps[-1]} were never reached; the loop "
                             f"ended after {self.iteration} steps. Call rec.step() once per iteration.")


def _explicit_groups(optimizer: Any) -> list[tuple[torch.Tensor, ...]]:
    groups = getattr(optimizer, "_groups", None)
    if not isinstance(groups, list):
        return []
    seen: dict[int, tuple[torch.Tensor, ...]] = {}
    for group in getattr(optimizer, "_p_to_group", {}).values():
        if len(group) > 1:
            seen[id(group)] = group
    return list(seen.values())


def _groups_knob(optimizer: Any) -> Any:
    groups = getattr(optimizer, "_groups", None)
    if groups is None:
        return None
    return "explicit" if isinstance(groups, list) else int(groups)


def record_horovod(model: nn.Module, optimizer: torch.optim.Optimizer, run_dir: str | Path | None = None,
                   steps: Iterable[int] = range(10, 20), *, total_steps: int | None = None) -> HorovodRecorder:
    """A recorder for a Horovod job: use it as a context manager and call ``step()`` once per iteration.

    Args:
        model: the model (Horovod does not wrap it).
        optimizer: the job's ``hvd.DistributedOptimizer``.
        run_dir: the run directory; see the module docstring for ``HOROVOD_TIMELINE``.
        steps: the iterations to record, counted from 0.
        total_steps: the loop's length if known (a window beyond it is refused at once).
    """
    return HorovodRecorder(model, optimizer, run_dir, steps, total_steps=total_steps)
