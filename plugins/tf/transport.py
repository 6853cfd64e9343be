"""The recording protocol's ``Transport`` for TensorFlow workers: a small TCP side channel.

MultiWorkerMirroredStrategy has no point-to-point op to time a ping-pong with, and its collectives are keyed
by the strategy's own counters (extra ones from a callback could shift them), so the workers talk over TCP:
worker 0 listens, the others connect to it (a star). The address is worker 0's host from ``TF_CONFIG``; the
port is ``$DPRO_TF_PORT`` or worker 0's TF_CONFIG port plus ``PORT_OFFSET``. Messages are length-prefixed
UTF-8 JSON; nothing read is evaluated.

``timed_allreduce`` measures nothing (see there): the communication model of a TensorFlow run comes from the
collectives of its profiled steps.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from dpro.errors import UsageError
from dpro.record.protocol import Clock

__all__ = ["PORT_OFFSET", "HorovodTransport", "SocketTransport", "default_transport", "horovod_running",
           "tf_config"]

PORT_OFFSET = 7919          # from worker 0's TF_CONFIG port to the side channel's, when DPRO_TF_PORT is unset
CONNECT_TIMEOUT_S = 120.0   # workers start seconds apart; the recording window starts on every worker
MAX_MESSAGE = 64 * 1024**2
_HEADER = struct.Struct("!Q")


def side_port_of(port: int) -> int:
    """The side channel's port from worker 0's TF_CONFIG port: ``PORT_OFFSET`` above it, wrapped into the
    unprivileged range (ports handed out by the kernel go up to 60999, and 60999 + 7919 is no port)."""
    return 1024 + (port - 1024 + PORT_OFFSET) % (65536 - 1024)


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


def _send(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the other worker closed the side channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_MESSAGE:
        raise ConnectionError(f"side-channel message of {size} bytes: larger than {MAX_MESSAGE}")
    return json.loads(_recv_exact(sock, size))


@dataclass
class SocketTransport:
    """``Transport`` over TCP between the workers of ``TF_CONFIG`` (see the module docstring)."""

    rank: int
    world_size: int
    backend: str = "tcp-side-channel"
    peers: dict[int, socket.socket] = field(default_factory=dict)   # on worker 0: rank -> socket
    hub: socket.socket | None = None                                # elsewhere: the socket to worker 0

    @classmethod
    def from_tf_config(cls, environ: dict[str, str] | None = None) -> SocketTransport:
        workers, index = tf_config(environ)
        env = os.environ if environ is None else environ
        if len(workers) <= 1:
            if horovod_size(env) > 1:  # each rank would take itself for a lone worker and share one run directory
                raise UsageError("this job runs under Horovod (HOROVOD_SIZE is set) but has no TF_CONFIG: its ranks "
                                 "talk through Horovod (default_transport, after hvd.init()), not TF_CONFIG")
            return cls(rank=0, world_size=1)
        host, _, port = workers[0].rpartition(":")
        try:
            side_port = int(env.get("DPRO_TF_PORT") or side_port_of(int(port)))
        except ValueError as err:
            raise UsageError(f"DPRO_TF_PORT / TF_CONFIG port is not a number: {err}") from err
        if not 0 < side_port < 65536:
            raise UsageError(f"DPRO_TF_PORT={side_port} is not a TCP port (1..65535)")
        transport = cls(rank=index, world_size=len(workers))
        transport._connect(host.strip("[]"), side_port)
        return transport

    def _connect(self, host: str, port: int) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        if self.rank == 0:
            server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind(("", port))
            except OSError as err:
                raise UsageError(f"dpro's TensorFlow side channel cannot listen on port {port}: {err.strerror}; "
                                 "set DPRO_TF_PORT to a free port (the same on every worker)") from err
            server.listen(self.world_size)
            server.settimeout(CONNECT_TIMEOUT_S)
            try:
                while len(self.peers) < self.world_size - 1:
                    conn, _ = server.accept()
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.peers[int(_recv(conn))] = conn
            except TimeoutError as err:
                raise UsageError(f"dpro's TensorFlow side channel: {len(self.peers) + 1} of {self.world_size} "
                                 f"workers connected to port {port} within {CONNECT_TIMEOUT_S:.0f} s") from err
            finally:
                server.close()
            return
        while True:
            try:
                self.hub = socket.create_connection((host, port), timeout=5.0)
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise UsageError(f"dpro's TensorFlow side channel: worker {self.rank} cannot reach worker 0 at "
                                     f"{host}:{port}: {err}") from err
                time.sleep(0.1)
        self.hub.settimeout(None)
        self.hub.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(self.hub, self.rank)

    def close(self) -> None:
        for sock in [*self.peers.values(), *([self.hub] if self.hub else [])]:
            sock.close()
        self.peers.clear()
        self.hub = None

    # ---- Transport -----------------------------------------------------------------------------------

    def broadcast_text(self, text: str, root: int = 0) -> str:
        if self.world_size == 1:
            return text
        return self.gather_texts(text)[root]

    def gather_texts(self, text: str) -> list[str]:
        if self.world_size == 1:
            return [text]
        if self.rank == 0:
            texts = [text] + [str(_recv(self.peers[r])) for r in range(1, self.world_size)]
            for r in range(1, self.world_size):
                _send(self.peers[r], texts)
            return texts
        _send(self.hub, text)
        return [str(t) for t in _recv(self.hub)]

    def barrier(self) -> None:
        self.gather_texts("")

    def ping(self, peer: int, clock: Clock) -> list[float] | None:
        if self.world_size == 1:
            return None
        if self.rank == 0:
            t0 = clock.now()
            _send(self.peers[peer], "ping")
            t1, t2 = _recv(self.peers[peer])
            return [t0, float(t1), float(t2), clock.now()]
        if self.rank == peer:
            _recv(self.hub)
            t1 = clock.now()
            _send(self.hub, [t1, clock.now()])
        return None

    def timed_allreduce(self, nbytes: int, name: str, clock: Clock) -> float:
        """Not measured here: a TCP exchange is not the strategy's all-reduce, and an extra collective from a
        callback would shift MWMS's collective keys. The recorder leaves the probe out; the cost model is fitted
        from the collectives of the profiled steps."""
        return 0.0


TEXT_BYTES = 4096  # a run directory path, an error message


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


class HorovodTransport:
    """Horovod's ranks as a ``dpro.record.protocol.Transport``, over ``horovod.tensorflow`` collectives (eager,
    between steps): Horovod has no point-to-point messages, so a ping is three broadcasts."""

    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        self._hvd = hvd
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.backend = "gloo" if hvd.gloo_enabled() else ("mpi" if hvd.mpi_enabled() else "horovod")

    @staticmethod
    def _encode(text: str, size: int) -> Any:
        import tensorflow as tf

        data = text.encode()[:size]
        return tf.constant(list(data) + [0] * (size - len(data)), dtype=tf.uint8)

    @staticmethod
    def _decode(row: Any) -> str:
        return bytes(row.numpy().tolist()).rstrip(b"\0").decode(errors="replace")

    def broadcast_text(self, text: str, root: int = 0) -> str:
        sent = self._encode(text if self.rank == root else "", TEXT_BYTES)
        return self._decode(self._hvd.broadcast(sent, root_rank=root, name="dpro.text"))

    def gather_texts(self, text: str) -> list[str]:
        import tensorflow as tf

        rows = self._hvd.allgather(tf.expand_dims(self._encode(text, 256), 0), name="dpro.texts")
        return [self._decode(row) for row in rows]

    def barrier(self) -> None:
        import tensorflow as tf

        # horovod.tensorflow 0.28 has no barrier: a small allreduce completes only once every rank joined it
        self._hvd.allreduce(tf.zeros(1), op=self._hvd.Sum, name="dpro.barrier").numpy()

    def ping(self, peer: int, clock: Clock) -> list[float] | None:
        """Rank 0 broadcasts at t0, ``peer`` reads t1 when it arrives; ``peer`` broadcasts, rank 0 reads t3; a third
        broadcast carries t1 to rank 0. Each waits for Horovod's next cycle: alignment keeps the shortest."""
        import tensorflow as tf

        zero = tf.zeros(1, dtype=tf.float64)
        t0 = clock.now()
        self._hvd.broadcast(zero, root_rank=0, name=f"dpro.clock.{peer}.a").numpy()
        t1 = clock.now()
        self._hvd.broadcast(zero, root_rank=peer, name=f"dpro.clock.{peer}.b").numpy()
        t3 = clock.now()
        times = self._hvd.broadcast(tf.constant([t1, t1], dtype=tf.float64), root_rank=peer,
                                    name=f"dpro.clock.{peer}.c").numpy()
        if self.rank != 0:
            return None
        return [t0, float(times[0]), float(times[1]), t3]

    def timed_allreduce(self, nbytes: int, name: str, clock: Clock) -> float:
        """Includes waiting for Horovod's cycle; the run's Horovod timeline gives the allreduce phases."""
        import tensorflow as tf

        tensor = tf.zeros(max(1, nbytes // 4), dtype=tf.float32)
        self.barrier()
        t0 = clock.now()
        self._hvd.allreduce(tensor, op=self._hvd.Sum, name=name).numpy()
        return clock.now() - t0


def default_transport() -> Any:
    """How this worker talks to the others: Horovod's collectives in a Horovod job, else the TCP side channel of
    ``TF_CONFIG`` (one worker without it)."""
    return HorovodTransport() if horovod_running() else SocketTransport.from_tf_config()
