"""Read TensorFlow profiler output (XPlane protobuf, ``*.xplane.pb``) into plain op and collective records.

``tf.profiler.experimental.start(logdir)`` / ``stop()`` write ``<logdir>/plugins/profile/<time>/<host>.xplane.pb``:
an ``XSpace`` whose ``/host:CPU`` plane has one line per thread. What dpro reads from it (checked on
TensorFlow 2.21, CPU):

- lines ``tf_Compute/<id>`` (the executor's inter-op threads): one event per op execution, named
  ``<op name>:<op type>``, e.g. ``sequential/fc1/Relu:_MklNativeFusedMatMul`` (forward) or
  ``gradient_tape/sequential/fc1/MatMul/MatMul_1:_MklMatMul`` (backward). Executor bookkeeping events
  (``ExecutorState::Process``, ``ThreadpoolListener::...``, named ``Class::method``) are left out;
- a collective's launch on the compute thread, ``CollectiveOpV2Kernel::Run`` with stats ``name`` (the op name,
  ``CollectiveReduceV2``, ``div_no_nan/CollectiveReduceV2``, ...) and ``_p`` (a correlation id); on the
  ``collective_ops/<id>`` lines, ``CollectiveExecutor::ExecuteAsync::Done`` with ``_c`` equal to that id
  marks its completion (its start: the event lasts while the executor runs, inline, the ops the result made
  ready), and ``<name>:CollectiveReduceV2`` with ``instance_key``/``group_key`` its transfer;
- an asynchronous kernel (Horovod's ``HorovodAllreduce``, ``IteratorGetNext``): ``ExecutorState::ProcessAsync::Start``
  on the compute thread with stats ``name``, ``kernel_type`` and ``_p`` is its launch, and
  ``ExecutorState::ProcessAsync::Done`` with ``_c`` equal to that id, on the thread that completed it (Horovod's
  background thread), starts when it completed;
- event times are ``XLine.timestamp_ns`` plus ``XEvent.offset_ps``, counted from the profile's start; the
  ``Task Environment`` plane holds ``profile_start_time`` (wall clock, ns since the epoch).

The protobuf is parsed with TensorFlow's own bindings (``tensorflow.tsl.profiler.protobuf.xplane_pb2``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpro.errors import TraceError

__all__ = ["AsyncOp", "Collective", "HostOp", "Profile", "find_xplane", "parse_xspace", "read_xplane"]

MAX_XPLANE_BYTES = 2 * 1024**3  # a host profile of a few steps is megabytes; refuse to load absurd files
HOST_PLANE = "/host:CPU"
COMPUTE_LINE = "tf_Compute"
COLLECTIVE_LINE = "collective_ops"
LAUNCH_EVENT = "CollectiveOpV2Kernel::Run"
DONE_EVENT = "CollectiveExecutor::ExecuteAsync::Done"
ASYNC_START_EVENT = "ExecutorState::ProcessAsync::Start"
ASYNC_DONE_EVENT = "ExecutorState::ProcessAsync::Done"


@dataclass(frozen=True)
class HostOp:
    """One op execution on an executor thread (times in ns on the wall clock)."""

    name: str       # the op's name in the graph, e.g. "gradient_tape/sequential/fc1/MatMul/MatMul_1"
    type: str       # the kernel, e.g. "_MklMatMul"
    start_ns: int
    dur_ns: int
    thread: str


@dataclass(frozen=True)
class Collective:
    """One collective op: launched on an executor thread, completed by the collective executor."""

    name: str         # op name, e.g. "CollectiveReduceV2" or "div_no_nan/CollectiveReduceV2"
    launch_ns: int
    done_ns: int
    transfer_start_ns: int | None
    transfer_end_ns: int | None
    instance_key: int | None


@dataclass(frozen=True)
class AsyncOp:
    """One asynchronous kernel: launched on an executor thread, completed by another (wall-clock ns)."""

    name: str         # op name, e.g. "DistributedSGD_Allreduce/cond_2/HorovodAllreduce_grads_2_0"
    type: str         # the kernel, e.g. "HorovodAllreduce"
    launch_ns: int
    done_ns: int | None  # None: its completion was not traced (the profiler stopped while it was being delivered)


@dataclass(frozen=True)
class Profile:
    start_wall_ns: int
    ops: list[HostOp]
    collectives: list[Collective]
    async_ops: list[AsyncOp] = field(default_factory=list)


def find_xplane(logdir: str | Path) -> Path:
    """The newest ``*.xplane.pb`` under ``logdir`` (``plugins/profile/<time>/<host>.xplane.pb``)."""
    files = sorted(Path(logdir).glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise TraceError(logdir, "no TensorFlow profile here (expected plugins/profile/<time>/<host>.xplane.pb)")
    return files[-1]


def read_xplane(path: str | Path) -> Profile:
    """Parse one ``.xplane.pb`` file into a ``Profile``; ``TraceError`` when it is not a readable XSpace."""
    from google.protobuf.message import DecodeError
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise TraceError(path, "not a file")
        if size > MAX_XPLANE_BYTES:
            raise TraceError(path, f"{size} bytes: larger than the {MAX_XPLANE_BYTES} bytes dpro reads")
        data = path.read_bytes()
    except OSError as err:
        raise TraceError(path, f"cannot read it: {err.strerror or err}") from err
    space = xplane_pb2.XSpace()
    try:
        space.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as err:
        raise TraceError(path, f"not a TensorFlow profile (XSpace protobuf): {err}") from err
    return parse_xspace(space, path)


def _stats(plane: Any, event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stat in event.stats:
        meta = plane.stat_metadata.get(stat.metadata_id)
        which = stat.WhichOneof("value")
        if meta is None or which is None:
            continue
        value = getattr(stat, which)
        if which == "ref_value":
            ref = plane.stat_metadata.get(value)
            value = ref.name if ref is not None else None
        out[meta.name] = value
    return out


def _profile_start(space: Any, path: Path) -> int:
    for plane in space.planes:
        if plane.name != "Task Environment":
            continue
        for stat in plane.stats:
            meta = plane.stat_metadata.get(stat.metadata_id)
            if meta is not None and meta.name == "profile_start_time" and stat.WhichOneof("value") == "uint64_value":
                return int(stat.uint64_value)
    raise TraceError(path, "no profile_start_time in the 'Task Environment' plane: cannot place its events in time")


def parse_xspace(space: Any, path: str | Path = "<xspace>") -> Profile:
    """The host ops and collectives of an ``XSpace`` message (see the module docstring)."""
    path = Path(path)
    start = _profile_start(space, path)
    host = next((p for p in space.planes if p.name == HOST_PLANE), None)
    if host is None:
        raise TraceError(path, f"no {HOST_PLANE} plane: not a host profile of TensorFlow")
    ops: list[HostOp] = []
    launches: dict[int, tuple[str, int]] = {}
    done: dict[int, int] = {}
    transfers: dict[str, list[tuple[int, int, int | None]]] = {}
    async_launches: dict[int, tuple[str, str, int]] = {}
    async_done: dict[int, int] = {}
    for line in host.lines:
        base_ps = (start + int(line.timestamp_ns)) * 1000
        on_compute = line.name.startswith(COMPUTE_LINE)
        on_collective = line.name.startswith(COLLECTIVE_LINE)
        for event in line.events:
            meta = host.event_metadata.get(event.metadata_id)
            if meta is None:
                continue
            t0 = (base_ps + int(event.offset_ps)) // 1000
            dur = int(event.duration_ps) // 1000
            if meta.name == ASYNC_DONE_EVENT:  # on whichever thread completed it
                stats = _stats(host, event)
                if isinstance(stats.get("_c"), int):
                    async_done[stats["_c"]] = t0
                continue
            if not (on_compute or on_collective):
                continue
            if on_compute and meta.name == ASYNC_START_EVENT:
                stats = _stats(host, event)
                if isinstance(stats.get("_p"), int) and isinstance(stats.get("name"), str):
                    async_launches[stats["_p"]] = (stats["name"], str(stats.get("kernel_type") or ""), t0)
            elif on_compute and meta.name == LAUNCH_EVENT:
                stats = _stats(host, event)
                if isinstance(stats.get("_p"), int) and isinstance(stats.get("name"), str):
                    launches[stats["_p"]] = (stats["name"], t0)
            elif on_compute and ":" in meta.name and "::" not in meta.name:  # "Class::method": bookkeeping
                name, _, kind = meta.name.rpartition(":")
                ops.append(HostOp(name=name, type=kind, start_ns=t0, dur_ns=dur, thread=line.name))
            elif on_collective and meta.name == DONE_EVENT:
                stats = _stats(host, event)
                if isinstance(stats.get("_c"), int):
                    # its start: the event goes on while the executor runs the ops the result made ready, inline on
                    # this thread (up to a few ms), after the value was delivered
                    done[stats["_c"]] = t0
            elif on_collective and ":" in meta.name and "::" not in meta.name:
                stats = _stats(host, event)
                key = stats.get("instance_key")
                transfers.setdefault(meta.name.rpartition(":")[0], []).append(
                    (t0, t0 + dur, key if isinstance(key, int) else None))
    collectives = []
    for corr, (name, t0) in sorted(launches.items(), key=lambda kv: kv[1][1]):
        if corr not in done:
            continue  # launched before the profile stopped, finished after it
        transfer = next((t for t in transfers.get(name, []) if t0 <= t[0] <= done[corr]), None)
        collectives.append(Collective(name=name, launch_ns=t0, done_ns=done[corr],
                                      transfer_start_ns=transfer[0] if transfer else None,
                                      transfer_end_ns=transfer[1] if transfer else None,
                                      instance_key=transfer[2] if transfer else None))
    ops.sort(key=lambda o: o.start_ns)
    async_ops = sorted((AsyncOp(name, kind, t0, async_done.get(corr)) for corr, (name, kind, t0)
                        in async_launches.items()), key=lambda a: a.launch_ns)
    return Profile(start_wall_ns=start, ops=ops, collectives=collectives, async_ops=async_ops)
