"""``GluonRecorder``: record a window of Gluon training steps (MXNet 1.x) into a dpro run directory.

MXNet runs every operator asynchronously on its engine, so the host's clock around a Python call says when work
was issued, not when it ran. The recorder reads completion instead: MXNet's ``wait_to_read`` returns once the
array's pending writes are done.

- **FW** of every block that holds parameters (and of every hybridized block, whose children run inside one
  cached graph): a forward pre-hook waits for the block's parameters (their pull from the servers) and stamps the
  start; the forward hook waits for the outputs and stamps the end. The forward therefore runs block by block,
  which is also what it does on one CPU device.
- **BW**: ``loss.backward()`` (or ``autograd.backward``) is issued as usual, and right after it a one-element copy
  of every gradient, which the engine runs once the gradient is written; helper threads stamp when each copy is
  done (waiting on the gradient itself would also wait for the pushpull that later writes into its buffer). A
  block's backward runs from the previous block's gradients to its own. MXNet bulks backward operators into
  segments (``MXNET_EXEC_BULK_EXEC_*``) and writes a segment's gradients together; the blocks of one segment share
  its time in proportion to their forward times (``args.estimated``), and the segment's gradients are ready at its
  end (the last block's ``grads``). A hybridized block's cached graph writes its blocks' gradients one by one too:
  each inner block with parameters gets a backward of its own, ending when its gradients are written.
- **COMM**: ``gluon.Trainer.step`` on a ``dist_*`` kvstore issues one ``pushpull`` per parameter (key = its index
  in the trainer): one ps-lite request carrying the gradient to the key's server(s) and the servers' answer, sent
  once every worker's push of that key has arrived (and, with ``update_on_kvstore``, the optimizer has run on the
  server). ``COMM.<grad>.push_pull`` runs from when both the gradient was ready and the request was issued to when
  the pulled weight is written; ``args.servers`` are the servers holding its parts (``dpro.engines.mxnet_ps``).
- **UPDATE**: on the worker only without ``update_on_kvstore`` (from the last pull to the weights written).
- **STEP**: from one step's end to the next; a step ends when ``step()`` is called and its pulls are done.

The workers agree on the run directory and exchange clock samples over dpro's TCP side channel
(``dpro.plugins.mxnet.transport``). After a window that ran to its end, each worker runs the compile probe on the
net's last recorded batch (``dpro.plugins.mxnet.probes``: imperative against ``hybridize(static_alloc=True)``,
written to ``RUN/probes/``); the recorded steps never include it.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from dpro.engines.mxnet_ps import DEFAULT_BIGARRAY_BOUND, SERVER_HOSTS_ENV, bigarray_bound, key_servers
from dpro.engines.mxnet_ps import NAME as ENGINE_PS
from dpro.errors import UsageError
from dpro.logs import get_logger
from dpro.plugins.mxnet.blocks import block_paths, hybridized_by_dpro, ndarrays
from dpro.plugins.mxnet.probes import run_compile_probes, write_probes
from dpro.plugins.mxnet.transport import default_transport
from dpro.record.backward import split_backward
from dpro.record.protocol import (
    Clock,
    Transport,
    agree_run_dir,
    claim_run_dir,
    clock_samples,
    host_cpu_busy_us,
    probes_wanted,
    usable_cpus,
)
from dpro.record.trace import QUEUE_ID, event_row, model_fingerprint
from dpro.record.window import WindowEnd, WindowRecorder, open_trace
from dpro.record.writer import model_document, run_document, write_model_json, write_run_json

__all__ = ["GluonRecorder", "Unit", "active_recorders", "block_paths", "fingerprint_of", "gradient_names",
           "recorded_units", "spread"]

logger = get_logger("dpro.plugins.mxnet")

COMPUTE, COMM, HOST = QUEUE_ID["compute"], QUEUE_ID["comm"], QUEUE_ID["host"]
_ACTIVE: weakref.WeakSet[GluonRecorder] = weakref.WeakSet()  # the one piece of process state DESIGN allows


def active_recorders() -> list[GluonRecorder]:
    """The recorders of this process not closed yet (lets auto-attach leave alone a script that records itself)."""
    return list(_ACTIVE)
WAIT_THREADS = 16  # threads waiting for arrays to be written (gradients, pulled weights)
SEGMENT_US = 50.0  # gradients ready within this of the previous block's came out of one bulked engine segment


PROBE_KEY = 2**30 + 104729  # far above a trainer's keys and the side channel's key
PROBE_ROUNDS = 8
PROBE_ELEMENTS = 1 << 20  # 4 MB: long enough for /proc/stat's 10 ms ticks over a few rounds
LINK_PROBE_SECONDS = 0.3  # one TCP stream per probed machine: long enough to leave its slow start behind
LINK_PROBE_MACHINES = 4   # machines probed at most (their links are taken alike): the probe stays under 1.5 s
PROBE_ATTRIBUTE = "_dpro_server_probe"  # on the kvstore: what its probe measured


@dataclass
class Unit:
    """A block timed as one op: a block with parameters of its own, or a hybridized block (its children run inside
    its cached graph), with the parameters it computes gradients for (trainer order)."""

    block: Any
    path: str
    params: list[Any] = field(default_factory=list)
    # a hybridized unit's blocks with parameters: (path, parameter bytes); its forward time is split over them
    parts: list[tuple[str, int]] = field(default_factory=list)
    part_params: list[list[Any]] = field(default_factory=list)  # each part's trained parameters (as ``parts``)

    def pieces(self) -> list[tuple[str, float]]:
        """(path, share of the unit's time) in forward order: the unit itself, or a hybridized unit's blocks
        by parameter bytes (MXNet runs its cached graph's forward as one bulk: the blocks' own times are not
        observable)."""
        if len(self.parts) <= 1:
            return [(self.path, 1.0)]
        total = sum(max(b, 1) for _, b in self.parts)
        return [(path, max(b, 1) / total) for path, b in self.parts]

    def backward_pieces(self) -> list[tuple[str, list[Any]]]:
        """(path, parameters) in backward order: a hybridized unit's blocks, each ending when its own gradients
        are written (the engine writes them one by one, as the cached graph's backward reaches them), or the
        unit as one."""
        if len(self.parts) <= 1 or len(self.part_params) != len(self.parts):
            return [(self.path, self.params)]
        mine = {id(p) for p in self.params}
        return [(path, [p for p in params if id(p) in mine])
                for (path, _), params in zip(reversed(self.parts), reversed(self.part_params), strict=True)]


def spread(start: float, stop: float, pieces: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """``[start, stop]`` cut into consecutive spans by the pieces' shares."""
    out, at = [], start
    for path, share in pieces:
        end = at + (stop - start) * share
        out.append((path, at, end))
        at = end
    return out


def _own_params(block: Any) -> list[Any]:
    return list(getattr(block, "_reg_params", {}).values())


def recorded_units(net: Any, trained: list[Any]) -> list[Unit]:
    """The units of ``net`` in forward (registration) order whose parameters the trainer trains: hybridized blocks
    as a whole (their innermost-first children are not called one by one), else every block with own parameters.
    A trained parameter no unit holds is left to the net itself (``path`` ``""``)."""
    trained_ids = {id(p): p for p in trained}
    units: list[Unit] = []
    owner: dict[int, Unit] = {}
    covered: set[int] = set()  # blocks inside a hybridized unit

    for block, path, _ in block_paths(net):
        if id(block) in covered:
            continue
        hybrid = bool(getattr(block, "_active", False))
        parts: list[tuple[str, int]] = []
        part_params: list[list[Any]] = []
        if hybrid:
            inner = block_paths(block)
            covered |= {id(b) for b, _, _ in inner}
            params = [p for b, _, _ in inner for p in _own_params(b)]
            for b, sub, _ in inner:
                own = [p for p in _own_params(b) if id(p) in trained_ids]
                if own:
                    full = ".".join(x for x in (path, sub) if x) or getattr(net, "name", "net")
                    parts.append((full, sum(_param_bytes(p) for p in own)))
                    part_params.append(own)
        else:
            params = _own_params(block)
        params = [p for p in params if id(p) in trained_ids and id(p) not in owner]
        if not params:
            continue
        unit = Unit(block, path or (getattr(block, "name", "") if block is net else path), params, parts, part_params)
        units.append(unit)
        for p in params:
            owner[id(p)] = unit
    rest = [p for p in trained if id(p) not in owner]
    if rest:
        units.append(Unit(net, getattr(net, "name", "net"), rest))
    return units


def gradient_names(net: Any, params: list[Any]) -> dict[int, str]:
    """Each trainer parameter's name (by its index): the path of the block holding it and the parameter's name
    inside the block (``1.weight``, ``features.0.bias``); a parameter no block holds keeps its Gluon name."""
    named: dict[int, str] = {}
    for block, path, _ in block_paths(net):
        for p in _own_params(block):
            short = param_short_name(p, block)
            named.setdefault(id(p), f"{path}.{short}" if path else short)
    return {i: named.get(id(p), str(p.name)) for i, p in enumerate(params)}


def fingerprint_of(net: Any, params: list[Any]) -> str:
    """The model hash of run.json (``model_fingerprint``): each trained gradient's name, shape and dtype, in the
    order the recorder lists them (backward). Hybridizing blocks leaves it as it is (the same parameters, in the same
    order), so a config that hybridizes still fits the job it was made for."""
    index = {id(p): i for i, p in enumerate(params)}
    names = gradient_names(net, params)
    units = recorded_units(net, [p for p in params if p.grad_req != "null"])
    return model_fingerprint((names[index[id(p)]], [int(d) for d in p.list_data()[0].shape],
                              np.dtype(p.list_data()[0].dtype).name)
                             for unit in reversed(units) for p in reversed(unit.params))


def param_short_name(param: Any, block: Any) -> str:
    """A parameter's name inside its block (``weight`` for ``dense0_weight`` of block ``dense0_``)."""
    prefix = getattr(block, "prefix", "") or ""
    name = str(param.name)
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _first_element(array: Any) -> Any:
    """A copy of ``array``'s first element: an engine op that reads ``array`` (so runs after its pending writes)
    and writes an array of its own."""
    return array.reshape((-1,))[0:1].copy()


def _param_bytes(param: Any) -> int:
    data = param.list_data()[0]
    return int(data.size) * np.dtype(data.dtype).itemsize


@dataclass
class _Step:
    """What one recorded step measured (µs on the rank's clock)."""

    step: int
    begin: float
    forward: dict[str, tuple[float, float]] = field(default_factory=dict)     # unit -> (start, end)
    backward_issued: float | None = None
    grad_ready: dict[int, float] = field(default_factory=dict)                # param index -> ready
    step_called: float | None = None                                          # trainer.step issued the pushpulls
    issued: dict[int, float] = field(default_factory=dict)                    # key -> its pushpull issued
    pulled: dict[int, float] = field(default_factory=dict)                    # param index -> weight written
    updated: float | None = None                                              # weights written (local update)
    marked: float | None = None                                               # Profiler.step() called
    written: dict[int, float] = field(default_factory=dict)                   # param index -> weight updated here
    waiters: list[Future] = field(default_factory=list)


class GluonRecorder(WindowRecorder):
    """Records steps ``steps`` of a Gluon training loop (see the module docstring).

    Args:
        net: the network trained (its blocks name the ops: ``FW.<path>``, ``BW.<path>``).
        trainer: the ``gluon.Trainer`` stepping it (its kvstore and parameters).
        run_dir: a new or empty directory, or None for ``dpro-runs/<timestamp>``; worker 0 decides.
        steps: the iterations to record, counted from 0.
        total_steps: when known, a window beyond it is refused at once.
        transport: how workers talk (default: dpro's TCP side channel next to the ps-lite scheduler).
        batch_size: samples per step on this worker (kept in run.json).

    It does not time its steps' ends for ``recording_overhead``: MXNet's engine runs an unrecorded step's operators
    after the loop has moved on, so its step boundaries time only the dispatch.
    """

    active = _ACTIVE
    measures_overhead = False

    def __init__(self, net: Any, trainer: Any, run_dir: str | Path | None, steps: Iterable[int], *,
                 total_steps: int | None = None, transport: Transport | None = None,
                 who: str = "dpro.plugins.mxnet.Profiler", batch_size: int | None = None) -> None:
        if not isinstance(net, gluon.Block):
            raise UsageError(f"{who}: net must be a gluon.Block, got {type(net).__name__}")
        if not isinstance(trainer, gluon.Trainer):
            raise UsageError(f"{who}: trainer must be a gluon.Trainer, got {type(trainer).__name__}")
        self.net, self.trainer = net, trainer
        super().__init__(steps, total_steps=total_steps, who=who)
        self.requested_dir = run_dir
        self.transport = transport
        self.batch_size = batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        self.server_probe: dict[str, Any] | None = None
        self.link_probe: dict[str, Any] | None = None
        self.probes = probes_wanted()
        self._batch: tuple[Any, ...] | None = None  # the net's arguments in its last recorded forward (the probes')
        self._current: _Step | None = None
        self._pending: _Step | None = None   # a finished step whose pulls may still be in flight
        self._hooks: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []
        self._units: list[Unit] = []
        self._lock = threading.Lock()

    # ---- the job's shape ------------------------------------------------------------------------------

    def _kvstore(self) -> Any:
        kv = getattr(self.trainer, "_kvstore", None)
        if kv is None:
            given = (getattr(self.trainer, "_kvstore_params", None) or {}).get("kvstore")
            kv = given if isinstance(given, mx.kvstore.KVStore) else None
        return kv

    def _distributed(self) -> bool:
        kv = self._kvstore()
        return kv is not None and "dist" in str(kv.type)

    def _update_on_kvstore(self) -> bool:
        return bool(self._distributed() and getattr(self.trainer, "_update_on_kvstore", False))

    # ---- step boundaries (``begin_step``: ``Profiler`` calls it, the first one also on entry; ``end_step``: after
    # ``trainer.step``) --------------------------------------------------------------------------------------------

    def _on_step_begin(self) -> None:
        if self.started and self.iteration in self.window:
            # a step begins where the one before it ended: once its pulls are done (``_finish_pending``)
            self._current = _Step(self.iteration, self.clock.now())

    def _on_step_end(self) -> None:
        step = self._current
        if step is not None:
            step.marked = self.clock.now()
            self._current = None
            self._finish_pending()
            self._pending = step
            if self.iteration + 1 not in self.window:
                self._finish_pending()

    # ---- window ----------------------------------------------------------------------------------------

    def _begin_window(self) -> None:
        kv = self._kvstore()
        if self.transport is None:
            self.transport = default_transport(kv)
        self.rank, self.world_size = self.transport.rank, self.transport.world_size
        self.clock = Clock.from_env(self.rank)
        self.host = socket.gethostname()
        self.run_dir = agree_run_dir(self.transport, self.requested_dir, self.who, claim_run_dir)
        self.hosts = self.transport.gather_texts(self.host)
        # the address ps-lite knows each worker by (a machine's, even for processes in network namespaces)
        self.worker_hosts = self.transport.gather_texts(os.environ.get("DMLC_NODE_HOST") or self.host)
        # the CPUs of each worker's machine this job may use: servers there run side by side on them
        cpus = self.transport.gather_texts(str(usable_cpus()))
        self.host_cpus = dict(zip(self.worker_hosts, (int(n) for n in cpus), strict=False))
        pingpong = clock_samples(self.transport, self.clock)
        self.server_probe = self._probe_server(kv)
        # the link probe wants quiet links: the previous step's push_pulls may still be on the wire (a stream beside
        # them reads well under the link's rate). The server probe stays before the wait, where it sees the server
        # as a running job does: after the wait its rounds run faster than in a job, read fewer CPUs and price
        # servers too slow
        mx.nd.waitall()
        self.transport.barrier()
        self.link_probe = self._probe_links()
        self._params = [p for p in self.trainer._params]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._units = recorded_units(self.net, [p for p in self._params if p.grad_req != "null"])
        self._names = gradient_names(self.net, self._params)
        self._writer = open_trace(self.run_dir, self.rank, self.world_size, host=self.host,
                                  device="host (MXNet wait_to_read)")
        if self.rank == 0:
            self._write_run_json(pingpong)
            self._write_model_json()
        self.transport.barrier()
        mx.nd.waitall()  # the window starts with nothing of the previous step in flight
        self._pool = ThreadPoolExecutor(max_workers=WAIT_THREADS, thread_name_prefix="dpro-mxnet-wait")
        self._install()

    def _install(self) -> None:
        for unit in self._units:
            self._hooks.append(unit.block.register_forward_pre_hook(self._pre_hook(unit)))
            self._hooks.append(unit.block.register_forward_hook(self._post_hook(unit)))
        if self.probes:
            self._hooks.append(self.net.register_forward_pre_hook(self._batch_hook))
        recorder = self

        def patch(owner: Any, name: str, make: Any) -> None:
            original = getattr(owner, name)
            self._patched.append((owner, name, original))
            setattr(owner, name, make(original))

        def backward_of(original: Any) -> Any:
            def backward(*args: Any, **kwargs: Any) -> Any:
                issued = recorder.clock.now()
                out = original(*args, **kwargs)
                recorder._backward_issued(issued)
                return out
            return backward

        def allreduce_of(original: Any) -> Any:  # inside Trainer.step and Trainer.allreduce_grads
            def allreduce_grads(*args: Any, **kwargs: Any) -> Any:
                called = recorder.clock.now()
                out = original(*args, **kwargs)
                recorder._pushpulls_issued(called)
                return out
            return allreduce_grads

        def update_of(original: Any) -> Any:  # inside Trainer.step and Trainer.update
            def update(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                recorder._update_issued()
                return out
            return update

        def pushpull_of(original: Any) -> Any:
            def pushpull(key: Any, *args: Any, **kwargs: Any) -> Any:
                step = recorder._current
                if step is not None and isinstance(key, int):
                    step.issued.setdefault(key, recorder.clock.now())
                return original(key, *args, **kwargs)
            return pushpull

        patch(mx.nd.NDArray, "backward", backward_of)
        patch(autograd, "backward", backward_of)
        patch(self.trainer, "_allreduce_grads", allreduce_of)
        patch(self.trainer, "_update", update_of)
        kv = self._kvstore()
        if kv is not None:
            patch(kv, "pushpull", pushpull_of)  # when each key's request is issued (in key order)

    def _uninstall(self) -> None:
        for handle in self._hooks:
            handle.detach()
        self._hooks.clear()
        for owner, name, original in reversed(self._patched):
            if isinstance(owner, (gluon.Trainer, mx.kvstore.KVStore)):
                delattr(owner, name)  # back to the class's method
            else:
                setattr(owner, name, original)
        self._patched.clear()

    # ---- hooks ------------------------------------------------------------------------------------------

    def _pre_hook(self, unit: Unit) -> Any:
        def hook(block: Any, inputs: Any) -> None:
            step = self._current
            if step is None:
                return
            if not step.forward:
                self._finish_pending()  # the previous step's pulls are done before this step's first block runs
            for p in unit.params:
                for data in p.list_data():
                    data.wait_to_read()  # its pull (the engine's forward would wait for it too)
            step.forward[unit.path] = (self.clock.now(), float("nan"))
        return hook

    def _post_hook(self, unit: Unit) -> Any:
        def hook(block: Any, inputs: Any, outputs: Any) -> None:
            step = self._current
            if step is None or unit.path not in step.forward:
                return
            for out in ndarrays(outputs):
                out.wait_to_read()
            start, _ = step.forward[unit.path]
            step.forward[unit.path] = (start, self.clock.now())
        return hook

    def _batch_hook(self, block: Any, inputs: Any) -> None:
        """Keep the net's arguments of a recorded step (by reference) for the probes after the window."""
        if self._current is not None and autograd.is_training():
            self._batch = tuple(inputs)

    def _backward_issued(self, issued: float) -> None:
        step = self._current
        if step is None or step.backward_issued is not None:
            return
        step.backward_issued = issued
        # a marker per gradient: a one-element copy the engine runs once the backward has written the gradient.
        # Waiting on the gradient itself would also wait for trainer.step's pushpull, which writes into it (the
        # kvstore sends and receives through the gradient's buffer) once it has been issued.
        markers = [(self._index[id(p)], [_first_element(g) for g in p.list_grad()])
                   for unit in reversed(self._units) for p in reversed(unit.params)]

        for i, copies in markers:
            self._submit(step, self._stamp_when_written, step.grad_ready, i, copies)

    def _pushpulls_issued(self, called: float) -> None:
        step = self._current
        if step is None or step.step_called is not None:
            return
        step.step_called = called
        if not self._distributed():
            return
        local_update = not self._update_on_kvstore()
        for i, p in enumerate(self._params):
            if p.grad_req != "null":  # the pull writes the weight, or (updated here) the gradient
                self._submit(step, self._stamp_when_written, step.pulled, i,
                             p.list_grad() if local_update else p.list_data())

    def _update_issued(self) -> None:
        step = self._current
        if step is None or self._update_on_kvstore():
            return
        if step.step_called is None:
            step.step_called = self.clock.now()
        for i, p in enumerate(self._params):
            if p.grad_req != "null":
                self._submit(step, self._stamp_when_written, step.written, i, p.list_data())

    def _stamp_when_written(self, into: dict[int, float], key: int, arrays: list[Any]) -> None:
        for array in arrays:
            array.wait_to_read()
        into[key] = self.clock.now()

    def _submit(self, step: _Step, *job: Any) -> None:
        # many threads, each blocked in one wait (MXNet releases the GIL there): a wait for an array finished early
        # does not queue behind one for an array finished late
        step.waiters.append(self._pool.submit(*job))

    # ---- rows -------------------------------------------------------------------------------------------

    def _finish_pending(self) -> None:
        with self._lock:
            step, self._pending = self._pending, None
        if step is None:
            return
        for future in step.waiters:
            future.result()
        step.updated = max(step.written.values()) if step.written else None
        end = max([step.marked or step.begin, *step.pulled.values(), step.updated or step.begin])
        following = self._current
        if following is not None and following.step == step.step + 1:
            following.begin = end
        if self._writer is not None and not self._writer.finished:
            self._writer.end_step(step.step, self.step_rows(step, end))

    def step_rows(self, step: _Step, end: float) -> list[list[Any]]:
        rows = [event_row("STEP", "STEP", HOST, step.begin, end - step.begin, {"step": step.step})]
        fw_us: dict[str, float] = {}
        for unit in self._units:
            span = step.forward.get(unit.path)
            if span is None or span[1] != span[1]:  # not run, or its hook did not finish (NaN)
                continue
            start, stop = span
            pieces = unit.pieces()
            for path, at, end in spread(start, stop, pieces):
                fw_us[path] = end - at
                args: dict[str, Any] = {"step": step.step}
                if len(pieces) > 1:
                    args["estimated"] = f"inside hybridized {unit.path or 'net'}: its time split by parameter bytes"
                rows.append(event_row(f"FW.{path}", "FW", COMPUTE, at, end - at, args))
        names = self._names
        if step.backward_issued is not None and step.grad_ready:
            last_fw = max((s for _, s in step.forward.values() if s == s), default=step.backward_issued)
            order = []
            grads_of: dict[str, list[int]] = {}
            inside: dict[str, str] = {}  # a hybridized unit's block -> the unit
            for unit in reversed(self._units):
                for path, params in unit.backward_pieces():
                    idx = [self._index[id(p)] for p in reversed(params) if self._index[id(p)] in step.grad_ready]
                    if not idx:
                        continue
                    grads_of[path] = idx
                    if path != unit.path:
                        inside[path] = unit.path or "net"
                    order.append((path, max(step.grad_ready[i] for i in idx), fw_us.get(path, 0.0)))
            spans = split_backward(order, max(step.backward_issued, last_fw), SEGMENT_US)
            sizes = Counter(seg for *_, seg in spans)
            for k, (path, start, stop, seg) in enumerate(spans):
                # a bulked segment's gradients are all ready at its end: its last unit carries them
                last = k + 1 == len(spans) or spans[k + 1][3] != seg
                carried = [i for p, *_, s in spans if s == seg for i in grads_of[p]] if last else []
                args = {"step": step.step, "grads": [names[i] for i in carried],
                        "grads_ready_us": [stop for _ in carried]}
                if sizes[seg] > 1:
                    shared = ("by parameter bytes (blocks inside hybridized " + inside[path] + ")"
                              if path in inside else "in proportion to forward time")
                    args["estimated"] = f"bulked backward segment, shared {shared}"
                rows.append(event_row(f"BW.{path}", "BW", COMPUTE, start, stop - start, args))
        if step.step_called is not None and step.pulled:
            servers, bound = self._servers(), bigarray_bound(dict(os.environ))
            for i in sorted(step.pulled):
                p = self._params[i]
                issued = step.issued.get(i, step.step_called)
                start = max(step.grad_ready.get(i, issued), issued)
                stop = max(step.pulled[i], start)
                nbytes = _param_bytes(p)
                parts = key_servers(i, int(p.list_data()[0].size), servers, bound)
                rows.append(event_row(f"COMM.{names[i]}.push_pull", "COMM", COMM, start, stop - start, {
                    "step": step.step, "tensors": [names[i]], "bytes": nbytes, "op": "push_pull",
                    "phase": "push_pull", "key": i, "servers": [s for s, _ in parts],
                    "part_bytes": [round(nbytes * share) for _, share in parts]}))
        if step.updated is not None:
            start = max([step.step_called or step.updated, *step.pulled.values()])
            rows.append(event_row("UPDATE.trainer", "UPDATE", COMPUTE, start, step.updated - start,
                                  {"step": step.step}))
        return rows

    def _servers(self) -> int:
        try:
            return max(1, int(os.environ.get("DMLC_NUM_SERVER", "1")))
        except ValueError:
            return 1

    # ---- close (``close``: finish the last step, write ``rank-<r>.json``) -------------------------------------

    def _end_window(self, error: BaseException | None) -> WindowEnd:
        if self._current is not None and error is None:
            self._current = None  # a step that was not marked as finished is not recorded
        self._finish_pending()
        self._uninstall()
        self._pool.shutdown(wait=True)
        return WindowEnd()

    def _after_window(self, error: BaseException | None) -> None:
        """The compile probe, on every worker of a window that ran to its end (the probe communicates nothing:
        the trainer is not stepped), then the transport closed."""
        batch, self._batch = self._batch, None
        try:
            if self.probes and error is None and self.iteration > self.steps[-1]:
                self._run_probes(batch)
        finally:
            self._close_transport()

    def _run_probes(self, batch: tuple[Any, ...] | None) -> None:
        try:
            doc = run_compile_probes(self.net, batch, self.rank)
            write_probes(self.run_dir, self.rank, doc)
        except Exception as err:  # noqa: BLE001 - a probe must never fail the job it measures
            logger.warning("%s: the probe passes after the window failed (%s: %s); the run has none", self.who,
                           type(err).__name__, err)

    # ---- run.json / model.json ---------------------------------------------------------------------------

    def _gradients(self) -> list[dict[str, Any]]:
        out = []
        for unit in reversed(self._units):  # backward order: the order gradients become ready
            for p in reversed(unit.params):
                i = self._index[id(p)]
                data = p.list_data()[0]
                out.append({"name": self._names[i], "bytes": _param_bytes(p), "shape": [int(d) for d in data.shape],
                            "dtype": np.dtype(data.dtype).name,
                            "module": self._names[i].rpartition(".")[0] or unit.path, "computed_by": unit.path,
                            "key": i})
        return out

    def fingerprint(self) -> str:
        return fingerprint_of(self.net, self._params)

    def knobs(self) -> dict[str, Any]:
        kv = self._kvstore()
        knobs: dict[str, Any] = {"world_size": self.world_size, "device": "cpu",
                                 "mxnet.kvstore": str(kv.type) if kv is not None else None,
                                 "update_on_kvstore": self._update_on_kvstore()}
        if self._distributed():
            knobs["num_servers"] = self._servers()
            knobs["mxnet.kvstore.bigarray_bound"] = bigarray_bound(dict(os.environ))
        optimizer = getattr(self.trainer, "_optimizer", None)
        if optimizer is not None:
            knobs["optimizer"] = type(optimizer).__name__
        if hybridized_by_dpro(self.net):  # the run is of a config's compile: what-if prices compiling no further
            knobs["compile"] = hybridized_by_dpro(self.net)
        return knobs

    def _probe_server(self, kv: Any) -> dict[str, Any] | None:
        """Time push_pulls of one key of our own, held by one server, as the window starts (the workers compute
        nothing; the previous step's push_pulls may still be finishing, as when it was checked against real jobs),
        and read how many CPUs each worker's machine kept busy meanwhile: what a parameter server's work takes of
        its machine's CPUs (its own threads, the workers' sending and receiving, the kernel's copies), which a
        recorded step cannot tell once two servers share the CPUs. Only on ``dist_sync``; with
        ``update_on_kvstore`` the servers run the optimizer on this key too, so it is pushed at most as often as
        the trainer's keys were (the optimizer's update count, which a learning-rate schedule reads, stays
        theirs)."""
        rounds = min(PROBE_ROUNDS, self.iteration - 1)  # the first push_pull warms up
        if kv is None or str(kv.type) != "dist_sync" or rounds < 2:  # the same answer on every worker: it is collective
            return None
        if hasattr(kv, PROBE_ATTRIBUTE):  # probed in an earlier window: its key is not initialised twice
            return getattr(kv, PROBE_ATTRIBUTE)
        bound = bigarray_bound(dict(os.environ))
        elements = max(1, min(PROBE_ELEMENTS, bound - 1))  # below the bound: one server holds it
        value = mx.nd.zeros((elements,), dtype="float32")
        out = mx.nd.zeros((elements,), dtype="float32")
        kv.init(PROBE_KEY, value)
        kv.pushpull(PROBE_KEY, value, out=out)
        out.wait_to_read()
        self.transport.barrier()
        began, busy = self.clock.now(), host_cpu_busy_us()
        for _ in range(rounds):
            kv.pushpull(PROBE_KEY, value, out=out)
            out.wait_to_read()
        wall, after = self.clock.now() - began, host_cpu_busy_us()
        cpus = self.transport.gather_texts(f"{(after - busy) / wall:.4f}" if wall > 0 and busy is not None
                                           and after is not None else "")
        walls = self.transport.gather_texts(f"{wall / rounds:.1f}")
        server = key_servers(PROBE_KEY, elements, self._servers(), bound)[0][0]
        probe = {"key": PROBE_KEY, "server": server, "bytes": 4 * elements, "rounds": rounds,
                 "us_per_round": [float(w) for w in walls if w],
                 "busy_cpus": [float(c) if c else None for c in cpus],
                 "note": "push_pulls of one key of dpro's on one server as the window starts; busy_cpus: per worker, "
                         "its machine's busy CPUs meanwhile (/proc/stat)"}
        setattr(kv, PROBE_ATTRIBUTE, probe)
        return probe

    def _probe_links(self) -> dict[str, Any] | None:
        """The rate one TCP stream gets from another machine of the job to worker 0's (dpro's side channel, nothing
        else running), for up to ``LINK_PROBE_MACHINES`` machines: what a link between machines carries, which the
        recorded pushes and answers cannot tell apart from the time each message waits on a busy link. None when
        every worker is on worker 0's machine or the transport cannot stream."""
        stream = getattr(self.transport, "stream_rate", None)
        if stream is None:
            return None
        first = {}  # machine -> its first worker
        for rank, host in enumerate(self.worker_hosts):
            if host != self.worker_hosts[0]:
                first.setdefault(host, rank)
        if not first:
            return None
        rates = []
        for host, rank in list(first.items())[:LINK_PROBE_MACHINES]:
            rate = stream(rank, LINK_PROBE_SECONDS)
            if self.rank == 0:
                rates.append({"from": host, "to": self.worker_hosts[0], "bytes_per_s": rate})
        return {"streams": rates, "seconds": LINK_PROBE_SECONDS,
                "note": "one TCP stream from a worker to worker 0, nothing else running; bytes_per_s over its second "
                        "half"}

    def _write_run_json(self, pingpong: dict[int, list[list[float]]]) -> None:
        versions = {"python": platform.python_version(), "mxnet": mx.__version__}
        engine = ENGINE_PS if self._distributed() else "mxnet"
        doc = run_document(framework="mxnet", engine=engine, versions=versions, world_size=self.world_size,
                           hosts=self.hosts, steps=list(self.steps), knobs=self.knobs(),
                           fingerprint=self.fingerprint(), probe=[], pingpong=pingpong,
                           extra={"mxnet": {"batch_size": self.batch_size,
                                            "server_hosts": [h for h in os.environ.get(SERVER_HOSTS_ENV, "").split(",")
                                                             if h] or None,
                                            "worker_hosts": self.worker_hosts,
                                            "host_cpus": self.host_cpus,
                                            "server_probe": self.server_probe,
                                            "link_probe": self.link_probe,
                                            "default_bigarray_bound": DEFAULT_BIGARRAY_BOUND,
                                            "note": "times from MXNet's wait_to_read on the rank's clock: FW per "
                                                    "block with parameters, BW from gradient readiness, one "
                                                    "push_pull per kvstore key"}})
        write_run_json(self.run_dir, doc)

    def _write_model_json(self) -> None:
        gradients = self._gradients()
        modules = []
        recorded = {path for u in self._units for path, _ in u.pieces()}
        for block, path, parent in block_paths(self.net):
            own = sum(_param_bytes(p) for p in _own_params(block) if p._data is not None)
            modules.append({"name": path or getattr(block, "name", "net"), "type": type(block).__name__,
                            "parent": parent if parent is None or parent else getattr(self.net, "name", "net"),
                            "param_bytes": own, "activation_bytes": None, "recorded": path in recorded})
        # no buckets: the kvstore sends one key per parameter (each gradient's "key")
        write_model_json(self.run_dir, model_document(fingerprint=self.fingerprint(), gradients=gradients,
                                                      buckets=[], modules=modules))
