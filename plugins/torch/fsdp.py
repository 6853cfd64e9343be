"""``FsdpRecorder``: record a window of an FSDP job (``torch.distributed.fsdp.fully_shard``) with PyTorch's own
profiler.

FSDP runs its all-gathers and reduce-scatters from hooks inside the forward and the backward, prefetching the next
unit's parameters while the current one computes. Module hooks of dpro's own would sit between FSDP's and miss the
collectives' own threads and streams, so the window is recorded by ``torch.profiler`` (Kineto): every operator, every
collective of the CPU backend's threads (``gloo:all_gather``) or every NCCL kernel, and FSDP's own annotations
(``FSDP::all_gather (i)``, ``FSDP::pre_backward (i)`` ...). Each rank writes its trace into the run directory
(``traces/rank-<r>.json``) when the window ends; ``run.json`` names the engine (``torch-fsdp``), the FSDP units and
how each reshards after forward. ``dpro analyze RUN`` analyzes the traces as it does any profiler traces, and
``dpro whatif RUN --set torch.fsdp.reshard_after_forward=false`` prices keeping the units unsharded.

The profiler marks each step (``ProfilerStep#N``, N the iteration) from one optimizer step's end to the next, so the
steps are the iterations the launcher counts. A job that stops inside the window leaves no trace: the profiler
writes it only when stopped.
"""

from __future__ import annotations

import logging
import os
import platform
import resource
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpro.engines.torch_fsdp.knobs import NAME as ENGINE
from dpro.engines.torch_fsdp.knobs import RESHARD as RESHARD_KNOB
from dpro.engines.torch_fsdp.knobs import TRACES_DIR
from dpro.plugins.torch.transport import TorchDistTransport
from dpro.record.protocol import (
    Clock,
    LocalTransport,
    Transport,
    agree_run_dir,
    check_window_fits,
    claim_run_dir,
    parse_steps,
    recording_overhead,
    step_ended,
)
from dpro.record.trace import model_fingerprint
from dpro.record.writer import run_document, write_run_json

__all__ = ["ENGINE", "RESHARD_KNOB", "TRACES_DIR", "FsdpRecorder", "fsdp_units", "is_fsdp_module"]

logger = logging.getLogger("dpro.plugins.torch.fsdp")

TRACE_FILE = "rank-{rank}.json"


def is_fsdp_module(module: Any) -> bool:
    """A module ``fully_shard`` was applied to (FSDP2: its class becomes a subclass of ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def fsdp_units(model: nn.Module, reshard: dict[int, Any] | None = None) -> list[dict[str, Any]]:
    """The FSDP units of ``model`` in registration order: path (``""`` for the root), parameter bytes of the
    unit's own parameters (not those of units inside it), and how it reshards after forward (``reshard``: what
    ``fully_shard`` was given, by module id; FSDP2's default otherwise: the root keeps its parameters, every
    other unit frees them)."""
    units = []
    inner: set[int] = set()
    modules = [(name, m) for name, m in model.named_modules() if is_fsdp_module(m)]
    for name, module in reversed(modules):  # innermost first: their parameters are theirs, not their parent's
        own = [p for p in module.parameters() if id(p) not in inner]
        inner.update(id(p) for p in own)
        given = (reshard or {}).get(id(module))
        units.append({"path": name, "parameter_bytes": int(sum(_local_bytes(p) for p in own)),
                      "reshard_after_forward": (name != "") if given is None else given})
    return list(reversed(units))


def _local_bytes(param: torch.Tensor) -> int:
    """The unsharded bytes of a parameter (a DTensor's global shape)."""
    return int(param.numel()) * param.element_size()


class FsdpRecorder:
    """Record iterations ``steps`` of an FSDP job's ``model`` with ``torch.profiler`` into ``run_dir``.

    ``step()`` ends an iteration (the launcher calls it after each optimizer step); iteration 0 is the first.
    ``close()`` stops the profiler and writes the trace if the window is still open (at exit)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, run_dir: str | Path | None,
                 steps: Iterable[int], *, total_steps: int | None = None, extra_knobs: dict[str, Any] | None = None,
                 reshard: dict[int, Any] | None = None, who: str = "dpro.plugins.torch.fsdp",
                 transport: Transport | None = None,
                 claim: Callable[[str | Path | None], Path] = claim_run_dir) -> None:
        self.who = who
        self.model, self.optimizer = model, optimizer
        self.steps = parse_steps(steps)
        check_window_fits(self.steps, total_steps, who)
        if transport is None:
            transport = TorchDistTransport() if dist.is_available() and dist.is_initialized() else LocalTransport()
        self.transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self.host = socket.gethostname()
        self.clock = Clock.from_env(self.rank)
        self.run_dir = agree_run_dir(transport, run_dir, who, claim)
        self.hosts = transport.gather_texts(self.host)
        self.units = fsdp_units(model, reshard)
        self.extra_knobs = dict(extra_knobs or {})
        self.iteration = 0
        self.trace_path: Path | None = None
        self._profiler: torch.profiler.profile | None = None
        self._closed = False
        self._step_ends: dict[int, tuple[float, float]] = {}
        self._run_doc: dict[str, Any] | None = None  # rank 0's run.json, completed with the peaks at the end

    @property
    def started(self) -> bool:
        return self._profiler is not None or self.trace_path is not None

    def start(self) -> None:
        """Nothing is recorded before the window's first iteration."""

    def step(self) -> None:
        """The end of an iteration: the profiler starts before the window's first, marks each one inside it, and
        stops (writing the trace) after its last."""
        if self._closed:
            return
        step_ended(self._step_ends, self.iteration, list(self.steps))
        self.iteration += 1
        if self.iteration == self.steps[0] and self._profiler is None:
            self._begin_window()
        elif self._profiler is not None and self.iteration <= self.steps[-1]:
            self._profiler.step()
        elif self._profiler is not None:
            self.close()

    def _begin_window(self) -> None:
        cuda = any(p.is_cuda for p in self.model.parameters())
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        if self.rank == 0:
            self._write_run_json()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        self.transport.barrier()
        # a schedule makes the profiler mark its steps (ProfilerStep#N): always recording, from iteration N on
        profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                          schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
        profiler.step_num = self.iteration
        profiler.start()
        self._profiler = profiler

    def close(self, error: BaseException | None = None) -> Path | None:
        """Stop the profiler and write this rank's trace (when the window was reached). Safe to call twice."""
        if self._closed:
            return self.run_dir
        self._closed = True
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return None
        profiler.stop()
        if error is None and self.iteration > self.steps[-1]:  # every rank is here, at the same iteration
            self._note_peak_memory()
        if error is not None or self.iteration <= self.steps[-1]:
            logger.warning("%s: the job stopped inside the window (%s); the profiler's trace is written with the "
                           "steps it finished", self.who, error or f"at iteration {self.iteration}")
        path = self.run_dir / TRACES_DIR / TRACE_FILE.format(rank=self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        profiler.export_chrome_trace(str(path))
        self.trace_path = path
        overhead = recording_overhead(self._step_ends, list(self.steps)) or {}
        logger.debug("%s: rank %d wrote %s in %.1f s (steps %+.1f%% against those before the window)", self.who,
                     self.rank, path, time.perf_counter() - began, overhead.get("wall_pct") or 0.0)
        return self.run_dir

    def _note_peak_memory(self) -> None:
        """Each rank's peak memory, in run.json (``fsdp.peak_memory_bytes``, by rank): what ``dpro optimize
        --memory-budget`` adds the units' gathered parameters to. On a GPU the caching allocator's peak since the
        window began; on a CPU the process's largest resident set so far (its training steps are its largest)."""
        cuda = torch.cuda.is_available() and any(p.is_cuda for p in self.model.parameters())
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        try:
            peaks = [int(v) for v in self.transport.gather_texts(str(int(peak)))]
        except (RuntimeError, ValueError, OSError) as err:
            logger.warning("%s: the ranks' peak memory could not be gathered (%s)", self.who, err)
            return
        if self.rank == 0 and self._run_doc is not None:
            self._run_doc["fsdp"]["peak_memory_bytes"] = peaks
            self._run_doc["fsdp"]["peak_memory_source"] = ("torch.cuda.max_memory_allocated in the window" if cuda
                                                           else "the process's largest resident set (ru_maxrss)")
            write_run_json(self.run_dir, self._run_doc)

    def knobs(self) -> dict[str, Any]:
        roots = [u for u in self.units if u["path"] == ""] or self.units[:1]
        inner = [u for u in self.units if u not in roots]
        reshard = sorted({str(u["reshard_after_forward"]) for u in inner})
        return {"world_size": self.world_size, "device": "cuda" if any(p.is_cuda for p in self.model.parameters())
                else "cpu", RESHARD_KNOB: (inner[0]["reshard_after_forward"] if len(reshard) == 1 else None)
                if inner else None, **self.extra_knobs}

    def _write_run_json(self) -> None:
        names = [(n, list(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()]
        doc = run_document(
            framework="torch", engine=ENGINE,
            versions={"python": platform.python_version(), "torch": torch.__version__},
            world_size=self.world_size, hosts=self.hosts, steps=list(self.steps), knobs=self.knobs(),
            fingerprint=model_fingerprint(names), probe=[], pingpong={},
            extra={"fsdp": {"units": self.units, "traces": f"{TRACES_DIR}/{TRACE_FILE.format(rank='<r>')}",
                            "recorder": "torch.profiler (Kineto), record_shapes",
                            "pid": os.getpid()}})
        self._run_doc = doc
        write_run_json(self.run_dir, doc)
