"""The torch recorder: module forwards, gradient, DDP-bucket and optimizer hooks of one rank.

``TorchRecorder`` is shared by ``Profiler`` (plain training loops) and the Lightning callback. It
installs its hooks only for the profiled steps and removes them afterwards, so steps outside the
window run the model untouched (module forwards are timed by a wrapper of each recorded module class's
``forward``, in place only while the window records). The one exception is DDP's communication hook, which DDP lets a
process register once: dpro registers a thin wrapper around DDP's default allreduce that, outside the
window, only forwards the call.

Timestamps come from the rank's host clock on CPU. When the model lives on CUDA every mark is a
CUDA event recorded on the current stream (device time, not host time around asynchronous work);
the events are turned into microseconds on the host clock once per profiled step.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import platform
import resource
import socket
import sys
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from dpro.errors import UsageError
from dpro.logs import get_logger
from dpro.plugins.torch.probes import MAX_JOINED, model_passes, run_probes, write_probes
from dpro.plugins.torch.transport import TorchDistTransport
from dpro.record.backward import split_backward
from dpro.record.protocol import (
    Clock,
    LocalTransport,
    Transport,
    agree_run_dir,
    allreduce_probe,
    check_window_fits,
    claim_run_dir,
    clock_samples,
    interference_probe,
    parse_steps,
    probes_wanted,
    step_ended,
    transfer_probe,
)
from dpro.record.trace import QUEUE_ID, event_row, model_fingerprint, probes_summary
from dpro.record.window import close_window, open_trace
from dpro.record.writer import (
    RankTraceWriter,
    model_document,
    run_document,
    write_model_json,
    write_run_json,
)

__all__ = ["BACKWARD_MARKS", "MECHANISMS", "TorchRecorder", "active_recorders", "in_backward", "is_compiling",
           "recorded_modules", "runs_compiled",
           "tensor_bytes", "timed_closure"]

COMPUTE, COMM, HOST = QUEUE_ID["compute"], QUEUE_ID["comm"], QUEUE_ID["host"]
logger = get_logger("dpro.plugins.torch")

_ACTIVE: weakref.WeakSet[TorchRecorder] = weakref.WeakSet()  # the one piece of process state DESIGN allows

MECHANISMS = ("forward", "backward", "grad_ready", "comm", "update")
"""What the recorder hooks, each of which can be left out (``mechanisms=``): module forwards (FW, and the end of IO;
a wrapper of the recorded classes' ``forward``), BW (by ``BACKWARD_MARKS``), post-accumulate-grad hooks (when each
gradient is ready), DDP's communication hook (COMM per bucket; without it DDP keeps its built-in allreduce),
optimizer step hooks (UPDATE). ``bench/overhead.py --breakdown`` prices each by leaving it out."""
BUILD_INTERVAL_S = 0.05
"""How often the builder thread journals the steps finished since: what a process killed outright can lose."""
BACKWARD_MARKS = ("gradients", "tensors")
"""How BW is timed: from one mark per backward pass and the gradient marks (each module from the gradients of the one
before it to its own), or from tensor hooks hung on module outputs and inputs (each module's own BW start and end)."""


def active_recorders() -> list[TorchRecorder]:
    """The recorders of this process that have been created and not closed yet (Profiler, DproCallback,
    dpro-launch's auto-attach); lets auto-attach leave alone a script that records itself."""
    return list(_ACTIVE)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a module's output (tensors, or tuples/lists/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def recorded_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that get FW/BW events: every leaf, and every module that owns parameters directly.

    The second kind matters for modules such as nn.MultiheadAttention, which compute with their
    own weights (and with a child's, out_proj) without calling the child.
    """
    chosen = []
    for name, mod in module.named_modules():
        is_leaf = next(mod.children(), None) is None
        owns_params = next(mod.parameters(recurse=False), None) is not None
        if (is_leaf or owns_params) and (name or owns_params):
            chosen.append((name or "<root>", mod))
    return chosen


@dataclass
class _BackwardMarks:
    """Raw marks of one backward pass (a step has several under gradient accumulation)."""

    bw_start: dict[str, Any] = field(default_factory=dict)    # module -> gradient of its output arrived
    bw_end: dict[str, Any] = field(default_factory=dict)      # module -> gradient of its input complete
    grad_ready: dict[str, Any] = field(default_factory=dict)  # parameter -> gradient accumulated
    # module -> the module whose output is its input: one tensor hook marks both (BW end of one, BW start of the other)
    bw_end_is_start_of: dict[str, str] = field(default_factory=dict)
    called: Any = None      # torch.autograd.backward was called (the pass's backward began; gradient marks only)
    first_forward: int = 0  # the pass's first entry in the step's ``forwards``


@dataclass
class _StepLog:
    """Raw marks of one profiled step, resolved to microseconds when the step ends."""

    start: Any = None
    gradient_marks: bool = False  # BW from the gradient marks (else from tensor hooks), as the step was recorded
    io_open: bool = True
    ops: list[tuple[str, str, int, Any, Any, dict]] = field(default_factory=list)  # name, cat, tid, t0, t1, args
    # module, t0, t1, output bytes, whether its output takes part in the backward
    forwards: list[tuple[str, Any, Any, int, bool]] = field(default_factory=list)
    backward: _BackwardMarks = field(default_factory=_BackwardMarks)   # the pass running or last run
    passes: list[_BackwardMarks] = field(default_factory=list)         # earlier passes of this step
    fw_open: dict[str, list[Any]] = field(default_factory=dict)  # module -> starts of forwards still running
    last_output: Any = None  # the last recorded module's output tensor that carries a BW-start hook, and its module
    last_output_of: str = ""
    model_forward_end: Any = None  # when the wrapped model's forward returned (DDP's own work follows)
    end: Any = None

    @property
    def activation_bytes(self) -> dict[str, int]:
        """Output bytes each module keeps for the backward: summed over its forwards in one pass (a module called
        twice keeps both outputs), in the pass that keeps most (each micro-batch frees its own before the next)."""
        kept: dict[str, int] = {}
        for _, span in self.pass_ranges():
            in_pass: Counter[str] = Counter()
            for name, _, _, nbytes, _ in self.forwards[span]:
                in_pass[name] += nbytes
            for name, nbytes in in_pass.items():
                kept[name] = max(kept.get(name, 0), nbytes)
        return kept

    def new_pass(self) -> None:
        """A forward after a finished backward: the next micro-batch of the same optimizer step."""
        self.passes.append(self.backward)
        self.backward = _BackwardMarks(first_forward=len(self.forwards))

    def pass_ranges(self) -> list[tuple[_BackwardMarks, slice]]:
        """Each backward pass of the step with where the forwards that came before it lie in ``forwards``."""
        marks = [*self.passes, self.backward]
        ends = [m.first_forward for m in marks[1:]] + [len(self.forwards)]
        return [(m, slice(m.first_forward, end)) for m, end in zip(marks, ends, strict=True)]


def _optimized_module_class() -> type | None:
    """torch.compile's module wrapper class, once torch.compile has been used in this process (else None: nothing
    is compiled, and torch._dynamo is not imported for nothing)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wraps, or ``model``."""
    optimized = _optimized_module_class()
    return model._orig_mod if optimized is not None and isinstance(model, optimized) else model


def runs_compiled(module: nn.Module, ddp: nn.Module | None) -> bool:
    """Whether torch.compile traces ``module`` or a part of it: a compiled submodule (a wrapper, or compiled in
    place by ``nn.Module.compile``), or a compiled wrapper of the
    module or of its DDP model (``torch.compile(ddp)`` makes a new module the recorder is not handed: it is found
    among the live objects)."""
    optimized = _optimized_module_class()
    if optimized is None or not _compiled_anything():
        return False
    if any(isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
           for m in module.modules()):  # a wrapper, or ``nn.Module.compile`` in place (dpro's compile knob)
        return True
    wrapped = {id(module), id(ddp)}
    # type(), not isinstance(): some live objects answer attribute lookups with deprecation warnings
    return any(issubclass(type(o), optimized) and id(o._orig_mod) in wrapped for o in gc.get_objects())


def _compiled_anything() -> bool:
    """Whether torch.compile has traced any frame in this process (Dynamo's own counters), before a heap scan."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return counters is None or sum(counters["frames"].values()) > 0


def is_compiling() -> bool:
    """True while torch.compile (Dynamo) traces the code that calls it; the recorder's hooks then step aside, so a
    compiled model runs as it would unrecorded (its modules untimed; steps, collectives and the optimizer are)."""
    return torch.compiler.is_compiling()


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread (a checkpointed module's forward
    recomputed there is RECOMPUTE, not the next micro-batch's forward)."""
    return torch._C._current_graph_task_id() != -1


def timed_closure(args: tuple, kwargs: dict, on_end: Callable[[], None]) -> tuple[tuple, dict] | None:
    """``optimizer.step(closure)``'s arguments with the closure wrapped to call ``on_end`` when it
    returns, or None when there is no closure. Lightning's automatic optimization, LBFGS and
    ``step(closure)`` loops run forward, backward and communication inside the closure: they are
    recorded as themselves, and UPDATE (the optimizer's own work) starts when the closure ends."""
    # torch passes the hook step()'s own arguments: args[0] is the optimizer, a positional closure is args[1]
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        return None

    def closure_then_mark(*a: Any, **kw: Any) -> Any:
        try:
            return closure(*a, **kw)
        finally:
            on_end()

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_mark}
    return (args[0], closure_then_mark, *args[2:]), kwargs


class TorchRecorder:
    """Records one rank of a torch job into a dpro run directory.

    Args:
        model: the model, plain ``nn.Module`` or wrapped in ``DistributedDataParallel``.
        optimizer: the optimizer whose ``step()`` is timed as UPDATE (None: no UPDATE events).
        run_dir: where to write the run; None makes a new timestamped directory under ``./dpro-runs``.
        steps: which iterations to record, counted from 0 (e.g. ``range(10, 20)``).
        total_steps: the run's length if known; a window beyond it is refused up front.
        ddp: the DDP wrapper when ``model`` is the inner module (Lightning holds them apart).
        extra_knobs: knobs in force that only the caller knows (e.g. Lightning's strategy).
        engine: the engine named in run.json; None derives it (torch-ddp, torch-dist or torch).
        who: the API name used in error messages.
        transport: the process group the recording protocol talks over (``dpro.record.protocol.Transport``);
            None: torch.distributed's default group when it is initialized, else a single process.
        claim: how rank 0 claims the run directory (default ``claim_run_dir``).
        mechanisms: which hooks to install (``MECHANISMS``, the default all of them); fewer cost less and record less.
        backward_marks: how BW is timed. ``"gradients"`` (the default): from the call to ``torch.autograd.backward``
            to the moments parameter gradients are accumulated (the grad_ready marks): each module from the gradients
            of the module before it to its own; a module without gradients of its own (an activation) shares the
            span up to the next module's in proportion to forward times (``args.estimated``). ``"tensors"``: hooks
            on each module's output and input tensors mark its own backward, exact per module at about 17 µs more
            per module and step on a CPU (also used when grad_ready is not among ``mechanisms``).
        probes: after the window, run the last recorded batch again under bf16/fp16 autocast and in slices
            (``dpro.plugins.torch.probes``: what prices the ``amp`` and ``micro_batches`` knobs); None: unless
            ``$DPRO_PROBES`` is "0".

    The training thread only takes timestamps; the steps' events are built and journaled by a background thread
    every ``BUILD_INTERVAL_S`` (``close`` waits for it), so a process killed outright may lose the steps it finished
    in the last 50 ms.

    Engines other than torch.distributed (Horovod) pass their own ``transport`` and add their entries
    to run.json through ``_run_extra``; the hooks are the same.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        run_dir: str | Path | None,
        steps: Iterable[int],
        *,
        total_steps: int | None = None,
        ddp: DistributedDataParallel | None = None,
        extra_knobs: dict[str, Any] | None = None,
        versions: dict[str, str] | None = None,
        engine: str | None = None,
        who: str = "dpro.plugins.torch.Profiler",
        transport: Transport | None = None,
        claim: Callable[[str | Path | None], Path] = claim_run_dir,
        mechanisms: Iterable[str] = MECHANISMS,
        backward_marks: str = "gradients",
        probes: bool | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
        model = _uncompiled(model)
        self.ddp = model if isinstance(model, DistributedDataParallel) else ddp
        self.module = self.ddp.module if isinstance(model, DistributedDataParallel) else model
        self.params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not self.params:
            raise UsageError(f"{who}: the model has no trainable parameters; there is nothing to record")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"{who}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.mechanisms = frozenset(mechanisms)
        unknown = sorted(self.mechanisms - set(MECHANISMS))
        if unknown:
            raise UsageError(f"{who}: unknown recording mechanisms {unknown}; choose from {', '.join(MECHANISMS)}")
        if backward_marks not in BACKWARD_MARKS:
            raise UsageError(f"{who}: backward_marks must be one of {', '.join(BACKWARD_MARKS)}, "
                             f"got {backward_marks!r}")
        self.backward_marks = backward_marks
        self._patched_backward: tuple[Callable, Callable] | None = None
        self.probes = probes_wanted() if probes is None else bool(probes)
        # the inner module's last recorded forward arguments, and whether its forward was replaced for the call
        self._batch: tuple[tuple, dict, bool] | None = None
        self._step_batches: list[tuple[tuple, dict, bool]] = []  # every forward's arguments in the current step
        self._probing = False
        self.runs_compiled = False  # torch.compile traces the model or a part of it (found when the window opens)
        self.steps = parse_steps(steps)
        check_window_fits(self.steps, total_steps, who)
        self.window = frozenset(self.steps)
        self.who = who
        self.engine = engine
        if transport is None:
            transport = TorchDistTransport() if dist.is_available() and dist.is_initialized() else LocalTransport()
        self.transport = transport
        self.distributed, self.rank, self.world_size = transport.world_size > 1, transport.rank, transport.world_size
        self.host = socket.gethostname()
        self.clock = Clock.from_env(self.rank)
        self.cuda = self.params[0][1].is_cuda
        if not self.cuda:
            self._mark = time.monotonic_ns  # the hot path: a C call per mark, turned into the clock's µs off it
        self._free_events: list[Any] = []  # CUDA events whose step has been resolved, recorded again
        self.extra_knobs = dict(extra_knobs or {})
        self.versions = {"python": platform.python_version(), "torch": torch.__version__, **(versions or {})}
        self.run_dir = agree_run_dir(transport, run_dir, who, claim)
        self.hosts = transport.gather_texts(self.host)
        self._param_name = {id(p): n for n, p in self.params}
        self._modules = recorded_modules(self.module)
        self._handles: list[Any] = []
        self._iteration = 0
        self._log: _StepLog | None = None
        self._recording = False
        self._suspended = False
        self._writer: RankTraceWriter | None = None
        self._closed = False
        self._fired: set[str] = set()
        self._last_log: _StepLog | None = None
        self._last_buckets: list[dict[str, Any]] = []
        self._cuda_ref: tuple[Any, float] | None = None
        self._step_ends: dict[int, tuple[float, float]] = {}  # iteration -> (wall, thread CPU) at its end
        self._bucket_tensors: dict[int, tuple[int, list[str]]] = {}  # bucket index -> (bytes, gradient names)
        self._builder: threading.Thread | None = None
        self._to_build: deque[tuple[_StepLog, int]] = deque()  # finished steps; appended without waking anyone
        self._stop_building = threading.Event()
        self._build_error: BaseException | None = None
        self.build_cpu_s = 0.0  # the builder thread's CPU time (what recording costs beside the training thread)
        _ACTIVE.add(self)

    # ---- setup -------------------------------------------------------------------------------

    def _run_extra(self) -> dict[str, Any]:
        """Engine-specific entries of run.json (rank 0, when recording starts)."""
        return {}

    def _install_comm_hook(self) -> None:
        """Registered when the window opens, not before: DDP takes one hook for the model's life, and steps before
        the window keep DDP's built-in allreduce. Outside the window the hook averages without timing."""
        if self.ddp is None or "comm" not in self.mechanisms:
            return
        if getattr(self.ddp, "_comm_hooks", None):
            # DDP accepts one hook per model; a user's own hook wins and COMM is not timed.
            logger.warning("%s: the DDP model already has a communication hook; COMM events are not recorded",
                        self.who)
            return
        self.ddp.register_comm_hook(self.ddp.process_group, self._comm_hook)

    def _comm_hook(self, group, bucket):  # noqa: ANN001 - DDP checks annotations, which would be strings here
        """DDP's average of a bucket, as ``allreduce_hook`` computes it, timed while the window records.

        A Python hook cannot fuse the division into DDP's copy of the gradients into the bucket (the built-in path
        does): ``allreduce_hook`` divides before the allreduce, an extra pass over the bucket on the training
        thread. Here float32/64 buckets are divided after it, in the future's callback, which runs where the
        allreduce completes; half precision still divides first (its sum could overflow)."""
        buffer = bucket.buffer()
        if buffer.is_complex():
            return allreduce_hook(group, bucket)
        size = group.size()
        divide_after = size > 1 and buffer.element_size() >= 4
        if size > 1 and not divide_after:
            buffer.div_(size)
        average = _averaged(size if divide_after else 1)
        timed = self._recording and "comm" in self.mechanisms
        log, step, mark = self._log, self._iteration, self._mark
        start = mark() if timed else None
        fut = group.allreduce([buffer]).get_future()
        if not timed:
            return fut.then(average)
        index, nbytes = bucket.index(), buffer.nbytes
        known = self._bucket_tensors.get(index)
        if known is None or known[0] != nbytes:  # buckets are rebuilt once, after DDP's first iteration
            known = self._bucket_tensors[index] = (nbytes, [self._param_name.get(id(p), "?")
                                                            for p in bucket.parameters()])

        def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            end = mark()
            log.ops.append((f"COMM.bucket{index}.allreduce", "COMM", COMM, start, end,
                            {"step": step, "bytes": nbytes, "tensors": known[1], "op": "allreduce",
                             "phase": "allreduce", "bucket": index}))
            return average(f)

        return fut.then(done)

    # ---- clock -------------------------------------------------------------------------------

    def _mark(self) -> Any:
        """A CUDA event recorded on the current stream (one from the pool when there is one)."""
        ev = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _resolve(self, mark: Any) -> float:
        """A mark in the rank clock's µs: CLOCK_MONOTONIC nanoseconds on the CPU, a completed CUDA event on a GPU."""
        if not self.cuda:
            return mark / 1000.0 + self.clock.skew_us
        ref_event, ref_us = self._cuda_ref
        return ref_us + ref_event.elapsed_time(mark) * 1000.0

    # ---- hooks -------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        mechanisms = self.mechanisms
        if "forward" in mechanisms:
            timed: dict[int, tuple[Callable, Callable]] = {}
            for name, mod in self._modules:
                if isinstance(mod, torch.jit.ScriptModule):
                    continue  # takes neither hooks nor a wrapper: its time stays in the gap before the next module
                pre, post = self._module_hooks(name, backward=self._tensor_marks)
                if "forward" in mod.__dict__:  # a forward of its own instance, which the class's does not reach
                    self._handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
                else:
                    timed[id(mod)] = (pre, post)
            if timed:
                self._handles += _time_class_forwards([mod for _, mod in self._modules if id(mod) in timed], timed)
            if self.ddp is not None:
                self._handles += self._ddp_forward_hooks()
            if self.probes:
                self._handles.append(self.module.register_forward_pre_hook(self._batch_hook(), with_kwargs=True))
        if "grad_ready" in mechanisms:
            for name, p in self.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready(name)))
        if self.optimizer is not None and "update" in mechanisms:
            self._handles += [
                self.optimizer.register_step_pre_hook(self._update_pre),
                self.optimizer.register_step_post_hook(self._update_post),
            ]
        if self._gradient_marks:
            self._patch_backward()

    @property
    def _tensor_marks(self) -> bool:
        """BW from tensor hooks on each module (``backward_marks="tensors"``, or no gradient marks to use)."""
        return "backward" in self.mechanisms and (self.backward_marks == "tensors"
                                                  or "grad_ready" not in self.mechanisms)

    @property
    def _gradient_marks(self) -> bool:
        return "backward" in self.mechanisms and not self._tensor_marks

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._patched_backward is not None:
            ours, original = self._patched_backward
            if torch.autograd.backward is ours:  # else someone wrapped it since: ours stays inert (not recording)
                torch.autograd.backward = original
            self._patched_backward = None

    def _patch_backward(self) -> None:
        """Mark when a backward pass begins: ``Tensor.backward`` (and Lightning's ``manual_backward``, AMP's scaled
        loss) calls ``torch.autograd.backward``, wrapped here while the window records; one mark per pass."""
        original, mark = torch.autograd.backward, self._mark

        def backward(*args: Any, **kwargs: Any) -> Any:
            log = self._log
            if self._recording and not self._suspended and log is not None and log.backward.called is None \
                    and not in_backward():
                log.backward.called = mark()
            return original(*args, **kwargs)

        torch.autograd.backward = backward
        self._patched_backward = (backward, original)

    def _module_hooks(self, name: str, *, backward: bool = True) -> tuple[Callable, Callable]:
        """What runs before and after one module's forward (called by the class-forward wrapper, or registered as
        module hooks where the wrapper cannot reach); with ``backward`` they also hang BW marks on its tensors.

        BW starts when the gradient of the module's output arrives (a hook on the output tensor)
        and ends when the gradient of its input is complete (a hook on the input tensor) or, for
        a module whose input needs no gradient, when its parameters' gradients are ready. Tensor
        hooks cost far less than nn.Module's full backward hooks and survive in-place ops. When a module's
        input is the previous recorded module's output (a chain of layers), that tensor already carries a hook:
        its mark is both that module's BW start and this one's BW end, and no second hook is hung.
        These run for every module in every recorded step: they take a timestamp and keep references, and
        leave everything else to the builder thread.
        """
        mark, is_grad_enabled, tensor_type = self._mark, torch.is_grad_enabled, torch.Tensor

        def bw_start(grad: torch.Tensor) -> None:
            self._log.backward.bw_start[name] = mark()

        def bw_end(grad: torch.Tensor) -> None:
            self._log.backward.bw_end[name] = mark()

        def pre(module: nn.Module, inputs: Any) -> None:
            if is_compiling():
                return  # inside a graph torch.compile traces: timestamps and tensor hooks are not for it to trace
            if not module.training and not is_grad_enabled():
                return  # evaluation inside a step (eval mode, no autograd): not the step's training work
            log = self._log
            now = mark()
            if log.io_open:
                self.batch_ready(now)
            recomputing = in_backward()
            passed = log.backward
            if (passed.bw_start or passed.grad_ready) and not recomputing:  # a backward ran (inline: hot path)
                log.new_pass()  # gradient accumulation: the next micro-batch's forward
            opened = log.fw_open.get(name)
            if opened is None:
                log.fw_open[name] = [now]
            else:
                opened.append(now)  # a stack: a module may run inside itself
            if backward and not recomputing and is_grad_enabled():
                for tensor in inputs:
                    if isinstance(tensor, tensor_type) and tensor.requires_grad:
                        if tensor is log.last_output:
                            log.backward.bw_end_is_start_of[name] = log.last_output_of
                        else:
                            tensor.register_hook(bw_end)

        def post(module: nn.Module, inputs: Any, output: Any) -> None:
            if is_compiling():
                return
            log = self._log
            opened = log.fw_open.get(name)
            if not opened:
                return
            start = opened.pop()
            if in_backward():
                # a checkpointed module computing its forward again inside backward
                log.ops.append((f"RECOMPUTE.{name}", "RECOMPUTE", COMPUTE, start, mark(), {"step": self._iteration}))
                return
            end = mark()
            if isinstance(output, tensor_type):
                log.forwards.append((name, start, end, output.nbytes, output.requires_grad))
                first = output
            else:
                first = _first_tensor(output)
                log.forwards.append((name, start, end, tensor_bytes(output), first is not None and first.requires_grad))
            if backward and first is not None and first.requires_grad:
                first.register_hook(bw_start)
                log.last_output, log.last_output_of = first, name

        return pre, post

    def _ddp_forward_hooks(self) -> list[Any]:
        """Time DDP's own work after the model's forward (``FW.ddp.post_forward``): preparing the reducer for the
        backward, which with ``find_unused_parameters`` searches the autograd graph from the outputs for the
        parameters this step will not use (what that flag costs every step)."""
        mark = self._mark

        def model_done(module: nn.Module, inputs: Any, output: Any) -> None:
            if not is_compiling() and not in_backward():
                self._log.model_forward_end = mark()

        def ddp_done(module: nn.Module, inputs: Any, output: Any) -> None:
            log = self._log
            start = log.model_forward_end
            if is_compiling() or in_backward() or start is None:
                return
            log.model_forward_end = None
            log.ops.append(("FW.ddp.post_forward", "FW", COMPUTE, start, mark(),
                            {"step": self._iteration,
                             "find_unused_parameters": bool(getattr(module, "find_unused_parameters", False))}))

        return [self.module.register_forward_hook(model_done), self.ddp.register_forward_hook(ddp_done)]

    def _grad_ready(self, name: str) -> Callable:
        mark = self._mark

        def hook(param: torch.Tensor) -> None:
            self._log.backward.grad_ready[name] = mark()

        return hook

    def _closure_ended(self) -> None:
        self._update_start = self._mark()

    def _update_pre(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[tuple, dict] | None:
        self._update_start = self._mark()
        return timed_closure(args, kwargs, self._closure_ended)

    def _update_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._log.ops.append(("UPDATE.optimizer", "UPDATE", COMPUTE, self._update_start, self._mark(),
                              {"step": self._iteration, "optimizer": type(optimizer).__name__}))

    # ---- the step window -----------------------------------------------------------------------

    def batch_ready(self, mark: Any = None) -> None:
        """Close the IO event of the current step: the batch is in hand (first forward, or a callback)."""
        log = self._log
        if log is None or not log.io_open:
            return
        log.io_open = False
        log.ops.append(("IO.batch", "IO", HOST, log.start, mark if mark is not None else self._mark(),
                        {"step": self._iteration}))

    def start(self) -> None:
        """Call once before the first iteration (iteration 0 begins now)."""
        self._iteration = 0
        if 0 in self.window:
            self._open_step()

    def step(self) -> None:
        """Call once at the end of every iteration."""
        if self._closed:
            self._iteration += 1
            return
        if self._recording:
            self._end_step()
        self._iteration += 1
        if self._iteration in self.window:
            self._open_step()
        elif self._recording:
            if not self._suspended:
                self._remove_hooks()
            self._recording = False
            self._block_ended()
        step_ended(self._step_ends, self._iteration - 1, self.steps)  # the overhead's clock
        if self._iteration > self.steps[-1]:
            self.close()

    def suspend(self) -> None:
        """Stop timing until ``resume``: work inside a step that is not training (Lightning's validation loop,
        a callback's evaluation) runs without hooks and shows as a gap. Safe outside the window."""
        if self._recording and not self._suspended:
            self._suspended = True
            self._remove_hooks()

    def resume(self) -> None:
        """Time again after ``suspend``."""
        if self._suspended:
            self._suspended = False
            if self._recording:
                self._install_hooks()
                if self._log is not None:  # the hooks in place from now on say how this step's BW is timed
                    self._log.gradient_marks = self._gradient_marks

    def _open_step(self) -> None:
        if self._writer is None:
            self._begin_window()
        if not self._recording:
            self._block_started()
            if not self._suspended:
                self._install_hooks()
            self._recording = True
        self._log = _StepLog(start=self._mark(), gradient_marks=self._gradient_marks)
        self._step_batches = []

    def _block_started(self) -> None:
        """A recorded block begins (the window's first step, or the first after a gap): what an engine records
        only while steps are recorded starts here."""

    def _block_ended(self) -> None:
        """A recorded block ended and a gap of unrecorded steps follows (not called when the window ends)."""

    def _begin_window(self) -> None:
        t0 = time.perf_counter()
        self.runs_compiled = runs_compiled(self.module, self.ddp)
        if {"forward", "backward"} & self.mechanisms and self.runs_compiled:
            # a wrapper of a module class's forward (or a hook) changes what torch.compile traced: the job would
            # compile again when the window opens, and pay for it in the recorded steps
            self.mechanisms -= {"forward", "backward"}
            if self.rank == 0:
                logger.warning("%s: the model runs under torch.compile; its modules are not timed (FW and BW are not "
                               "recorded), the steps, collectives, gradients and optimizer are", self.who)
        pingpong = clock_samples(self.transport, self.clock)
        if self.cuda:
            torch.cuda.synchronize()
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            ref.synchronize()
            self._cuda_ref = (ref, self.clock.now())
        self._install_comm_hook()
        self._writer = open_trace(self.run_dir, self.rank, self.world_size, host=self.host,
                                  device="cuda-events" if self.cuda else "host")
        if self.rank == 0:
            self._write_run_json(pingpong)
        self._builder = threading.Thread(target=self._build_steps, name=f"dpro-builder-{self.rank}", daemon=True)
        self._builder.start()
        # every rank begins the first recorded step together: rank 0's writes would otherwise show as the others
        # waiting at the first collective, a wait the job does not have
        self.transport.barrier()
        self._writer.header["window_start_ms"] = round((time.perf_counter() - t0) * 1000.0, 3)

    def _peak_memory(self) -> int:
        """Peak memory so far: CUDA's allocator peak on a GPU, the process's peak RSS on the CPU."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def _end_step(self) -> None:
        """The training thread's share of a step's end: one mark, then the step goes to the builder thread."""
        log = self._log
        log.end = self._mark()
        if "forward" in self.mechanisms:
            self.batch_ready(log.end)  # a step without a forward still closes its IO event
        log.last_output = None  # the builder keeps the log; not the activation
        self._to_build.append((log, self._iteration))

    def _build_steps(self) -> None:
        """The builder thread: every ``BUILD_INTERVAL_S`` (and once more when told to stop), turns the steps finished
        since into events and journals them, in order. Waking it at each step's end cost the training thread about
        25 µs per step (the wake-up and the GIL passed back and forth); a few steps at a time cost a fraction."""
        start_cpu = time.thread_time()
        while True:
            stopping = self._stop_building.wait(BUILD_INTERVAL_S)
            while self._to_build:
                item = self._to_build.popleft()
                if self._build_error is not None:
                    continue  # keep draining; the first error is reported by close()
                try:
                    self._build_step(*item)
                except BaseException as err:  # noqa: BLE001 - handed to close(), which reports it
                    self._build_error = err
            self.build_cpu_s = time.thread_time() - start_cpu
            if stopping:
                break

    def _build_step(self, log: _StepLog, step: int) -> None:
        if self.cuda:
            log.end.synchronize()
        rows, ready = self._step_rows(log, step)
        self._writer.end_step(step, rows)
        if self.cuda:
            self._free_events.extend(_events_of(log))
        self._last_log = log
        self._last_ready = ready
        self._last_buckets = _buckets_of(rows)
        if self.rank == 0 and len(self._writer.steps_done) == 1:
            self._write_model_json()

    def _step_rows(self, log: _StepLog, step: int) -> tuple[list[list[Any]], dict[str, float]]:
        """The events of one step's log (sorted by start), and when each gradient was ready in its last pass."""
        resolve = self._resolve
        t_start = resolve(log.start)
        rows = [event_row("STEP", "STEP", HOST, t_start, resolve(log.end) - t_start,
                          {"step": step, "peak_memory_bytes": self._peak_memory()})]
        forwards = [(name, resolve(t0), resolve(t1), nbytes, needs_grad)
                    for name, t0, t1, nbytes, needs_grad in log.forwards]
        for name, ts, te, nbytes, _ in forwards:
            rows.append(event_row(f"FW.{name}", "FW", COMPUTE, ts, te - ts, {"step": step, "bytes": nbytes}))
            self._fired.add(name)
        for name, cat, tid, t0, t1, args in log.ops:
            ts = resolve(t0)
            rows.append(event_row(name, cat, tid, ts, resolve(t1) - ts, args))
            if cat == "FW":
                self._fired.add(name[3:])
        grads_of = self._grads_by_module()
        ready: dict[str, float] = {}
        for marks, forwards_before in log.pass_ranges():
            ready = {n: resolve(m) for n, m in marks.grad_ready.items()}
            if log.gradient_marks:
                rows += self._backward_rows(log, marks, forwards[forwards_before], ready, grads_of, step)
                continue
            bw_end = dict(marks.bw_end)
            for name, alias in marks.bw_end_is_start_of.items():
                if alias in marks.bw_start:
                    bw_end.setdefault(name, marks.bw_start[alias])
            for name, t0 in marks.bw_start.items():
                grads = [g for g in grads_of.get(name, ()) if g in ready]
                ends = [resolve(bw_end[name])] if name in bw_end else []
                ts = resolve(t0)
                t1 = max(ends + [ready[g] for g in grads]) if (ends or grads) else ts
                rows.append(event_row(f"BW.{name}", "BW", COMPUTE, ts, t1 - ts,
                                      {"step": step, "grads": grads, "grads_ready_us": [ready[g] for g in grads]}))
        rows.sort(key=lambda row: row[3])
        return rows, ready

    def _backward_rows(self, log: _StepLog, marks: _BackwardMarks, forwards: list[tuple[str, float, float, int, bool]],
                       ready: dict[str, float], grads_of: dict[str, list[str]], step: int) -> list[list[Any]]:
        """BW events of one pass from its gradient marks (``backward_marks="gradients"``; ``split_backward``);
        ``forwards``: the pass's forwards, resolved to µs."""
        resolve = self._resolve
        order: list[tuple[str, float | None, float]] = []
        seen: set[str] = set()
        grads_in: dict[str, list[str]] = {}
        fw_end = None
        for name, start, end, _, needs_grad in forwards:
            fw_end = end if fw_end is None else max(fw_end, end)
            if name in seen:
                continue  # a module run twice in a pass: its gradients are ready once, after both backwards
            seen.add(name)
            grads = [g for g in grads_of.get(name, ()) if g in ready]
            if grads or needs_grad:
                grads_in[name] = grads
                order.append((name, max(ready[g] for g in grads) if grads else None, end - start))
        if not order:
            return []
        began = resolve(marks.called) if marks.called is not None else fw_end
        busy = [(resolve(t0), resolve(t1)) for _, cat, _, t0, t1, _ in log.ops if cat == "RECOMPUTE"]
        spans = split_backward(order[::-1], began, busy=busy)
        sizes = Counter(seg for *_, seg in spans)
        rows = []
        for name, t0, t1, seg in spans:
            grads = grads_in[name]
            args: dict[str, Any] = {"step": step, "grads": grads, "grads_ready_us": [ready[g] for g in grads]}
            if sizes[seg] > 1:
                args["estimated"] = "modules between two gradient marks: their span split by forward times"
            rows.append(event_row(f"BW.{name}", "BW", COMPUTE, t0, t1 - t0, args))
        return rows

    def _finish_building(self) -> None:
        """Wait for the builder thread to journal every finished step."""
        if self._builder is None:
            return
        self._stop_building.set()
        self._builder.join()
        self._builder = None
        if self._build_error is not None:
            logger.error("%s: building the recorded events failed on rank %d: %s", self.who, self.rank,
                         self._build_error)

    def probe_pass(self, args: tuple, kwargs: dict, cast: contextlib.AbstractContextManager,
                   loss_of: Callable[[Any], torch.Tensor | None]) -> tuple[dict[str, float], float, int]:
        """One probe pass (``dpro.plugins.torch.probes``): the inner module's forward on ``args``/``kwargs`` under
        ``cast``, then the backward of ``loss_of(output)``, timed by the hooks in place -> each FW/BW op's µs, the
        pass's µs, and the activation bytes its modules kept."""
        log = _StepLog(start=self._mark(), gradient_marks=self._gradient_marks, io_open=False)
        self._log = log
        with cast:
            output = self.module(*args, **kwargs)
        loss = loss_of(output)
        if loss is None:
            raise ValueError("the model's output holds no floating tensor that needs a gradient")
        loss.backward()
        log.end = self._mark()
        log.last_output = None
        if self.cuda:
            log.end.synchronize()
        rows, _ = self._step_rows(log, -1)
        ops: dict[str, float] = {}
        for name, cat, _, _, dur_ns, _ in rows:  # event_row keeps integer nanoseconds
            if cat in ("FW", "BW", "RECOMPUTE"):
                ops[name] = ops.get(name, 0.0) + dur_ns / 1000.0
        return ops, self._resolve(log.end) - self._resolve(log.start), sum(log.activation_bytes.values())

    def _run_probes(self) -> dict[str, Any] | None:
        """The probe passes after the window (``dpro.plugins.torch.probes``), written to ``RUN/probes/``; a DDP or
        single-process model only (other engines' gradient hooks would communicate). Never raises."""
        batch, self._batch = self._batch, None
        step_batches, self._step_batches = self._step_batches, []
        if not self.probes or (self.distributed and self.ddp is None) or self.module is None:
            return None
        self._probing = True
        try:
            doc = run_probes(self, batch, step_batches)
            write_probes(self.run_dir, self.rank, doc)
        except Exception as err:  # noqa: BLE001 - a probe must never fail the job it measures
            logger.warning("%s: the probe passes after the window failed (%s); the run has none", self.who, err)
            return None
        finally:
            self._probing = False
        return doc

    def _batch_hook(self) -> Callable[[nn.Module, tuple, dict], None]:
        """A forward pre-hook that keeps the inner module's forward arguments (by reference) for the probes after
        the window. A closure, not a bound method: ``copy.deepcopy`` of the model (an EMA copy made while recording)
        copies a bound method's recorder, and shares a function; the copy's calls are not kept."""
        inner = self.module

        def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if module is inner and module.training and not self._probing and not is_compiling() \
                    and not in_backward():
                # a forward put on the instance for this call only (Lightning redirects training_step through
                # it), not one dpro's configs put there: these are not the forward's own arguments
                redirected = "forward" in module.__dict__ and not hasattr(module, "_dpro_precise_forward")
                self._batch = (args, kwargs, redirected)
                if len(self._step_batches) <= MAX_JOINED:  # one more than the probes join: too many
                    self._step_batches.append(self._batch)

        return keep

    def close(self, error: BaseException | None = None) -> Path | None:
        """End recording: write this rank's trace (and model.json on rank 0). Safe to call twice."""
        if self._closed:
            return self.run_dir
        self._closed = True
        _ACTIVE.discard(self)
        self._remove_hooks()
        self._recording = False
        if self._writer is None:
            self._release_model()
            return None
        self._finish_building()
        done = self._writer.steps_done
        failed = self._build_error
        close_window(self._writer, self.steps, error=error, step_ends=self._step_ends,
                     problems=[f"building the events failed: {type(failed).__name__}: {failed}"] if failed else [],
                     overhead_extra={"builder_cpu_ms_per_step": round(self.build_cpu_s * 1000.0 / max(len(done), 1),
                                                                      3)})
        if self.rank == 0 and done:
            self._write_model_json()
        if error is None and self._iteration > self.steps[-1]:  # every rank is here, at the same step
            batch = self._batch
            probes = self._run_probes()
            self._probe_after_window(probes, batch)
        self._release_model()
        return self.run_dir

    def _probe_after_window(self, probes: dict[str, Any] | None = None,
                            batch: tuple[tuple, dict, bool] | None = None) -> None:
        """Time allreduces of a few sizes on the job's process group (run.json's ``comm_probe``), after the window:
        megabyte allreduces before it made the recorded steps of a Horovod job on an emulated link faster than the
        same job unrecorded (the connections stay warmed up), and the model is of the job as it runs.
        A probe that fails is logged; the job goes on."""
        doc = getattr(self, "_run_doc", None)
        if self.rank == 0 and doc is not None and probes is not None:
            doc["probes"] = probes_summary(probes)
            write_run_json(self.run_dir, doc)
        try:
            probe = allreduce_probe(self.transport, self.clock)
            with self._probe_compute(batch) as model_pass:
                interference = interference_probe(
                    self.transport, self.clock, model_pass or self._probe_kernel(), probe,
                    compute_is="the model's forward and backward" if model_pass else "a fixed kernel")
                transfer = transfer_probe(self.transport, self.clock, model_pass or self._probe_kernel(chunk=True),
                                          probe)
        except (RuntimeError, ValueError, OSError) as err:
            logger.warning("%s: the probe after the window failed (%s); the run has no probe", self.who, err)
            return
        if self.rank == 0 and doc is not None:
            doc["comm_probe"]["samples"] = probe
            if interference is not None:
                doc["interference_probe"] = interference
            if transfer is not None:
                doc["transfer_probe"] = transfer
            write_run_json(self.run_dir, doc)

    def _probe_compute(self, batch: tuple[tuple, dict, bool] | None
                       ) -> contextlib.AbstractContextManager[Callable[[], None] | None]:
        """The interference probes' compute: the model's own forward and backward on the captured batch
        (``probes.model_passes``) where the probe passes may run it (a DDP or single-process model: other engines'
        gradient hooks would communicate), else None (``_probe_kernel`` stands in)."""
        if not self.probes or (self.distributed and self.ddp is None):
            return contextlib.nullcontext(None)
        return model_passes(self, batch)

    def _probe_kernel(self, chunk: bool = False) -> Callable[[], None]:
        """The interference probe's compute: matrix products of a fixed size, about a few ms on one CPU core (a
        ``chunk``: a twelfth of that, which the transfer probe runs over and over until its allreduce is done)."""
        device = "cuda" if self.cuda else "cpu"
        size = 1024 if self.cuda else 256
        # a generator of its own: the job's random stream goes on as if no probe had run
        a = torch.randn(size, size, device=device, generator=torch.Generator(device).manual_seed(0))
        repeat = (64 if self.cuda else 12) // (12 if chunk else 1)

        def compute() -> None:
            for _ in range(repeat):
                torch.mm(a, a)
            if self.cuda:
                torch.cuda.synchronize()

        return compute

    def _release_model(self) -> None:
        """Drop references to the model: DDP's reducer keeps our comm hook (and so this object) alive,
        and a DDP model that is never freed can abort gloo when the process group is torn down."""
        self.ddp = self.module = self.optimizer = self._batch = None
        self._step_batches = []
        self.params, self._modules, self._param_name = [], [], {}
        self._log = self._last_log = None

    @property
    def iteration(self) -> int:
        return self._iteration

    @property
    def started(self) -> bool:
        return self._writer is not None

    # ---- run.json / model.json -----------------------------------------------------------------

    def _grad_owner(self) -> dict[str, str]:
        """Gradient name -> the recorded module that computes it (nearest recorded ancestor that ran)."""
        cache = getattr(self, "_owner_cache", None)
        if cache is not None and cache[0] == len(self._fired):
            return cache[1]
        names = {n for n, _ in self._modules}
        owner = {}
        for pname, _ in self.params:
            path = pname.rsplit(".", 1)[0] if "." in pname else "<root>"
            candidate = path
            while candidate not in names or (self._fired and candidate not in self._fired):
                if candidate in ("", "<root>"):
                    candidate = path if path in names else "<root>"
                    break
                candidate = candidate.rsplit(".", 1)[0] if "." in candidate else "<root>"
            owner[pname] = candidate
        self._owner_cache = (len(self._fired), owner)
        return owner

    def _grads_by_module(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for grad, module in self._grad_owner().items():
            out.setdefault(module, []).append(grad)
        return out

    def knobs(self) -> dict[str, Any]:
        knobs: dict[str, Any] = {"world_size": self.world_size, "device": "cuda" if self.cuda else "cpu"}
        if self.distributed:
            knobs["backend"] = self.transport.backend
        if self.ddp is not None:
            ddp = self.ddp
            knobs.update({
                "torch.ddp.bucket_cap_mb": ddp.bucket_bytes_cap / 2**20,
                "torch.ddp.first_bucket_cap_mb": _first_bucket_cap_mb(ddp),
                "torch.ddp.gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
                "torch.ddp.find_unused_parameters": bool(ddp.find_unused_parameters),
                "torch.ddp.static_graph": bool(getattr(ddp, "static_graph", False)),
                "torch.ddp.broadcast_buffers": bool(ddp.broadcast_buffers),
                "torch.ddp.comm_hook": _comm_hook_in_use(ddp, self._comm_hook),
            })
            caps = getattr(getattr(ddp, "_bucket_config", None), "per_bucket_bytes_caps", ())
            if caps:
                knobs["torch.ddp.bucket_cap_mb_list"] = [c / 2**20 for c in caps]
        if self.optimizer is not None:
            knobs["optimizer"] = type(self.optimizer).__name__
        from dpro.plugins.torch.apply import amp_in_force, compiled, recomputed

        if recomputed(self.module):
            knobs["recompute"] = recomputed(self.module)
        if compiled(self.module):
            knobs["compile"] = compiled(self.module)
        if amp_in_force(self.module):
            knobs["amp"] = amp_in_force(self.module)
        knobs.update(self.extra_knobs)
        return knobs

    def fingerprint(self) -> str:
        return model_fingerprint((n, p.shape, str(p.dtype)) for n, p in self.params)

    def _write_run_json(self, pingpong: dict[int, list[list[float]]]) -> None:
        engine = self.engine or (
            "torch-ddp" if self.ddp is not None else ("torch-dist" if self.distributed else "torch"))
        doc = run_document(framework="torch", engine=engine, versions=self.versions, world_size=self.world_size,
                           hosts=self.hosts, steps=list(self.steps), knobs=self.knobs(), fingerprint=self.fingerprint(),
                           probe=[], pingpong=pingpong, extra=self._run_extra())
        write_run_json(self.run_dir, doc)
        self._run_doc = doc  # the probe after the window fills its comm_probe

    def _write_model_json(self) -> None:
        last = self._last_log
        ready = getattr(self, "_last_ready", {})
        owner = self._grad_owner()
        params = dict(self.params)
        order = sorted(params, key=lambda n: (ready.get(n, float("inf")), n))
        gradients = [
            {"name": n, "bytes": params[n].numel() * params[n].element_size(), "shape": list(params[n].shape),
             "dtype": str(params[n].dtype).replace("torch.", ""), "module": n.rsplit(".", 1)[0] if "." in n else "",
             "computed_by": owner[n], "ready_us": ready.get(n)}
            for n in order
        ]
        recorded = {n for n, _ in self._modules}
        modules = []
        for name, mod in self.module.named_modules():
            key = name or "<root>"
            direct = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
            modules.append({
                "name": key, "type": type(mod).__name__,
                "parent": (name.rsplit(".", 1)[0] if "." in name else "<root>") if name else None,
                "param_bytes": direct,
                "activation_bytes": (last.activation_bytes.get(key) if last else None),
                "recorded": key in recorded and key in self._fired,
            })
        doc = model_document(fingerprint=self.fingerprint(), gradients=gradients, buckets=self._last_buckets,
                             modules=modules)
        write_model_json(self.run_dir, doc)


def _buckets_of(rows: list[list[Any]]) -> list[dict[str, Any]]:
    """The DDP buckets a step's COMM rows name, each once: a step that runs several backward passes (gradient
    accumulation whose forwards ran outside ``no_sync``) allreduces the same bucket once per pass."""
    buckets: dict[int, dict[str, Any]] = {}
    for row in rows:
        args = row[5]
        if row[1] == "COMM" and "bucket" in args:
            buckets.setdefault(args["bucket"], {"index": args["bucket"], "bytes": args["bytes"],
                                                "tensors": args["tensors"]})
    return [buckets[i] for i in sorted(buckets)]


def _averaged(size: int) -> Callable[[torch.futures.Future[list[torch.Tensor]]], torch.Tensor]:
    """The callback that turns an allreduce's sum into the mean over ``size`` ranks (1: already divided)."""
    def average(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        summed = f.value()[0]
        return summed.div_(size) if size > 1 else summed

    return average


def _events_of(log: _StepLog) -> list[Any]:
    """Every CUDA event a step's log holds (returned to the pool once the step is resolved)."""
    events = [log.start, log.end]
    events += [m for _, t0, t1, _, _ in log.forwards for m in (t0, t1)]
    events += [m for op in log.ops for m in op[3:5]]
    for marks in [*log.passes, log.backward]:
        events += [*marks.bw_start.values(), *marks.bw_end.values(), *marks.grad_ready.values()]
        events += [marks.called] if marks.called is not None else []
    return list({id(ev): ev for ev in events}.values())


class _ClassForwardPatch:
    """The timed ``forward`` of one module class, in place while a window records; ``remove()`` puts the class's own
    back. Hooks registered on a module make every call of it take nn.Module's slow path (about 7 µs per module and
    call on a CPU, where a wrapper of ``forward`` costs under 2 µs), so recorded modules are timed here instead.
    The wrapper is on the class, not the instance: a copy of a module made while recording (``copy.deepcopy`` for an
    EMA model) must run its own forward, and instances that are not recorded pass straight through."""

    def __init__(self, cls: type, original: Callable, timed: dict[int, tuple[Callable, Callable]]) -> None:
        self.cls, self.timed = cls, timed
        self.had_own = "forward" in cls.__dict__
        self.own = cls.__dict__.get("forward")

        @functools.wraps(original)
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if is_compiling():  # traced by torch.compile: the compiled graph runs the module untimed
                return original(module, *args, **kwargs)
            hooks = timed.get(id(module))
            if hooks is None:
                return original(module, *args, **kwargs)
            pre, post = hooks
            pre(module, args)
            output = original(module, *args, **kwargs)
            post(module, args, output)
            return output

        self.forward = forward
        cls.forward = forward

    def remove(self) -> None:
        self.timed.clear()  # inert from now on, even if another wrapper was put over ours since
        if self.cls.__dict__.get("forward") is self.forward:
            if self.had_own:
                self.cls.forward = self.own
            else:
                del self.cls.forward


def _time_class_forwards(modules: list[nn.Module], timed: dict[int, tuple[Callable, Callable]]) -> list[Any]:
    """Wrap the ``forward`` of each class of ``modules``: a call of a module in ``timed`` (id -> pre and post hook)
    runs between its two hooks. Every class's forward is looked up before any is wrapped, so a recorded subclass
    that inherits the forward of another recorded class is timed once."""
    classes = {type(mod): None for mod in modules}
    originals = {cls: cls.forward for cls in classes}
    return [_ClassForwardPatch(cls, originals[cls], timed) for cls in classes]


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, (tuple, list)):
        return next((o for o in obj if isinstance(o, torch.Tensor)), None)
    return None


def _comm_hook_in_use(ddp: DistributedDataParallel, ours: Callable) -> str:
    hooks = getattr(ddp, "_comm_hooks", None)
    if not hooks:
        return "built-in allreduce"
    return "dpro timing wrapper around allreduce_hook" if hooks[0][0] == ours else "user hook"


def _first_bucket_cap_mb(ddp: DistributedDataParallel) -> float | None:
    config = getattr(ddp, "_bucket_config", None)  # torch >= 2.13 keeps the caps here
    cap = getattr(config, "first_bucket_bytes_cap", None)
    return cap / 2**20 if cap else None
