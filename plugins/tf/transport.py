"""The recording protocol's ``Transport`` for TensorFlow workers.

- MultiWorkerMirroredStrategy workers: the TCP side channel of ``dpro.record.socket_transport`` (MWMS has no
  point-to-point op, and extra collectives from a callback could shift the strategy's collective keys). Worker
  0's host comes from ``TF_CONFIG``; the port is ``$DPRO_TF_PORT`` or worker 0's TF_CONFIG port plus
  ``PORT_OFFSET`` (``tf_socket_transport``).
- Horovod ranks (hvd.keras): Horovod's own collectives (``CollectiveTransport(HorovodCollectives())``, the core's
  transport over them, as the torch plugin's Horovod recorder does with ``horovod.torch``'s).

``default_transport`` picks the one this process needs.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from dpro.errors import UsageError
from dpro.record.collective_transport import CollectiveTransport
from dpro.record.protocol import Clock
from dpro.record.socket_transport import PORT_OFFSET, SocketTransport, side_port_of

__all__ = ["PORT_OFFSET", "HorovodCollectives", "SocketTransport", "default_transport", "horovod_running",
           "side_port_of", "tf_config", "tf_socket_transport"]

PORT_VARIABLE = "DPRO_TF_PORT"


def horovod_size(environ: dict[str, str] | os._Environ) -> int:
    """The number of Horovod ranks horovodrun announced to this process (0 when it did not start it)."""
    try:
        return int(environ.get("HOROVOD_SIZE") or 0)
    except ValueError:
        return 0


def tf_config(environ: dict[str, str] | None = None) -> tuple[list[str], int]:
    """(worker addresses, this worker's index) from ``TF_CONFIG``; ``([], 0)`` when it is unset."""
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
    if not text.strip():
        return [], 0
    try:
        doc = json.loads(text)
        workers = list(doc["cluster"]["worker"])
        task = doc.get("task", {})
        index = int(task.get("index", 0))
        kind = task.get("type", "worker")
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"TF_CONFIG is not valid: {err}; expected "
                         '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}') from err
    if kind not in ("worker", "chief") or not all(isinstance(w, str) and ":" in w for w in workers):
        raise UsageError(f"TF_CONFIG: dpro records worker tasks given as host:port; got task {kind!r}, "
                         f"workers {workers!r}")
    if not 0 <= index < len(workers):
        raise UsageError(f"TF_CONFIG: task index {index} is outside the {len(workers)} workers")
    return workers, index


def tf_socket_transport(environ: dict[str, str] | None = None) -> SocketTransport:
    """The side channel between the workers ``TF_CONFIG`` names: worker 0's host, port ``$DPRO_TF_PORT`` or worker
    0's TF_CONFIG port plus ``PORT_OFFSET``; one worker without TF_CONFIG."""
    workers, index = tf_config(environ)
    env = os.environ if environ is None else environ
    if len(workers) <= 1:
        if horovod_size(env) > 1:  # each rank would take itself for a lone worker and share one run directory
            raise UsageError("this job runs under Horovod (HOROVOD_SIZE is set) but has no TF_CONFIG: its ranks "
                             "talk through Horovod (default_transport, after hvd.init()), not TF_CONFIG")
        return SocketTransport(rank=0, world_size=1)
    host, _, port = workers[0].rpartition(":")
    try:
        side_port = int(env.get(PORT_VARIABLE) or side_port_of(int(port)))
    except ValueError as err:
        raise UsageError(f"{PORT_VARIABLE} / TF_CONFIG port is not a number: {err}") from err
    return SocketTransport.connect(index, len(workers), host, side_port, label="dpro's TensorFlow side channel",
                                   port_variable=PORT_VARIABLE)




def horovod_running(environ: dict[str, str] | os._Environ | None = None) -> bool:
    """Whether this process is a rank of a Horovod job (``horovod.tensorflow`` initialized, started by horovodrun)
    rather than a TF_CONFIG worker."""
    env = os.environ if environ is None else environ
    if "TF_CONFIG" in env or horovod_size(env) < 1:
        return False
    hvd = sys.modules.get("horovod.tensorflow")
    try:
        return hvd is not None and bool(hvd.is_initialized())
    except (AttributeError, ValueError):
        return False


class HorovodCollectives:
    """``horovod.tensorflow``'s collectives (eager, between steps) as
    ``dpro.record.collective_transport.Collectives`` (numpy in and out)."""

    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        self._hvd = hvd
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.backend = "gloo" if hvd.gloo_enabled() else ("mpi" if hvd.mpi_enabled() else "horovod")

    def broadcast(self, data: Any, root: int, name: str) -> Any:
        import tensorflow as tf

        return self._hvd.broadcast(tf.constant(data), root_rank=root, name=name).numpy()

    def allgather(self, data: Any, name: str) -> Any:
        import tensorflow as tf

        return self._hvd.allgather(tf.constant(data), name=name).numpy()

    def barrier(self) -> None:
        import tensorflow as tf

        # horovod.tensorflow 0.28 has no barrier: a small allreduce completes only once every rank joined it
        self._hvd.allreduce(tf.zeros(1), op=self._hvd.Sum, name="dpro.barrier").numpy()

    def allreduce(self, nbytes: int, name: str) -> None:
        import tensorflow as tf

        self._hvd.allreduce(tf.zeros(max(1, nbytes // 4), dtype=tf.float32), op=self._hvd.Sum, name=name).numpy()

    def allreduce_during(self, nbytes: int, name: str, compute: Callable[[], None],
                         clock: Clock) -> tuple[float, float]:
        """``compute`` run while an allreduce of ``nbytes`` is in flight: (its µs, µs the allreduce ran on after
        it). horovod.tensorflow has no handle to wait on in eager mode, so the allreduce runs on a thread of its
        own (TensorFlow releases the GIL while an op runs)."""
        import tensorflow as tf

        zeros = tf.zeros(max(1, nbytes // 4), dtype=tf.float32)
        ended: list[float] = []
        thread = threading.Thread(target=lambda: (self._hvd.allreduce(zeros, op=self._hvd.Sum, name=name).numpy(),
                                                  ended.append(clock.now())), daemon=True)
        thread.start()
        t0 = clock.now()
        compute()
        t1 = clock.now()
        thread.join()
        return t1 - t0, max(0.0, (ended[0] if ended else t1) - t1)


def default_transport() -> CollectiveTransport | SocketTransport:
    """How this worker talks to the others: Horovod's collectives in a Horovod job, else the TCP side channel of
    ``TF_CONFIG`` (one worker without it)."""
    return CollectiveTransport(HorovodCollectives()) if horovod_running() else tf_socket_transport()
