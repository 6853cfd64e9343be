"""A ``Transport`` over TCP, for frameworks whose workers have no point-to-point op to time a ping-pong with or whose
collectives a recorder must not touch (TensorFlow's MultiWorkerMirroredStrategy keys its collectives by its own
counters; MXNet's parameter server has only push and pull): worker 0 listens, the others connect to it (a star).
Messages are length-prefixed UTF-8 JSON; nothing read is evaluated. Each plugin says where worker 0 is (TF_CONFIG,
the launcher's environment) and calls ``SocketTransport.connect``.

``timed_allreduce`` measures nothing: a TCP exchange is not the framework's collective, so the communication model
of such a run comes from the collectives of its profiled steps. ``stream_rate`` measures what one TCP stream gets
from one worker's machine to worker 0's: the link between them, where they are on different machines.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from dpro.errors import UsageError
from dpro.record.protocol import Clock

__all__ = ["CONNECT_TIMEOUT_S", "PORT_OFFSET", "SocketTransport", "side_port_of", "steady_rate"]

PORT_OFFSET = 7919          # from a framework port the workers know to the side channel's, when not given
CONNECT_TIMEOUT_S = 120.0   # workers start seconds apart; the recording window starts on every worker
MAX_MESSAGE = 64 * 1024**2
STREAM_CHUNK = 256 * 1024   # bytes per frame of ``stream_rate``: many frames per measurement on a slow link
_HEADER = struct.Struct("!Q")


def side_port_of(port: int) -> int:
    """The side channel's port from a port every worker knows: ``PORT_OFFSET`` above it, wrapped into the
    unprivileged range (ports handed out by the kernel go up to 60999, and 60999 + 7919 is no port)."""
    return 1024 + (port - 1024 + PORT_OFFSET) % (65536 - 1024)


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


def steady_rate(marks: list[tuple[float, int]]) -> float | None:
    """Bytes per second over the second half (by time) of a stream's arrivals ``(seconds, bytes so far)``: the
    first half holds the connection's slow start and what the link's queues let through at once; None when too few
    arrivals to tell."""
    if len(marks) < 4 or marks[-1][0] <= marks[0][0]:
        return None
    middle = marks[0][0] + (marks[-1][0] - marks[0][0]) / 2
    t0, b0 = next((t, b) for t, b in marks if t >= middle)
    t1, b1 = marks[-1]
    return (b1 - b0) / (t1 - t0) if t1 > t0 else None


@dataclass
class SocketTransport:
    """``Transport`` over TCP between the workers of one job (see the module docstring). ``label`` names the
    channel in errors, ``port_variable`` the environment variable that picks its port."""

    rank: int
    world_size: int
    backend: str = "tcp-side-channel"
    peers: dict[int, socket.socket] = field(default_factory=dict)   # on worker 0: rank -> socket
    hub: socket.socket | None = None                                # elsewhere: the socket to worker 0
    label: str = "dpro's side channel"
    port_variable: str = "the side channel's port"

    @classmethod
    def connect(cls, rank: int, world_size: int, host: str, port: int, *, label: str = "dpro's side channel",
                port_variable: str = "the side channel's port", listener: socket.socket | None = None
                ) -> SocketTransport:
        """Worker 0 listens on ``port`` (or accepts on ``listener``, from ``listen``); the others connect to
        ``host:port`` (retrying while worker 0 starts)."""
        if not 0 < port < 65536:
            raise UsageError(f"{port_variable}={port} is not a TCP port (1..65535)")
        transport = cls(rank=rank, world_size=world_size, label=label, port_variable=port_variable)
        if world_size > 1:
            transport._connect(host.strip("[]"), port, listener)
        elif listener is not None:
            listener.close()
        return transport

    @staticmethod
    def listen(host: str, port: int, *, any_port: bool = False, label: str = "dpro's side channel",
               port_variable: str = "the side channel's port") -> socket.socket:
        """Worker 0's listening socket on ``port``, or, with ``any_port``, on a free port the kernel picks when
        ``port`` is taken (a framework's own connections may hold it): for a plugin that tells the other workers the
        port it got (``listener.getsockname()[1]``)."""
        server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            try:
                server.bind(("", port))
            except OSError:
                if not any_port:
                    raise
                server.bind(("", 0))
        except OSError as err:
            server.close()
            raise UsageError(f"{label} cannot listen on port {port}: {err.strerror}; set {port_variable} to a free "
                             "port (the same on every worker)") from err
        return server

    def _connect(self, host: str, port: int, listener: socket.socket | None = None) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        if self.rank == 0:
            server = listener or self.listen(host, port, label=self.label, port_variable=self.port_variable)
            server.listen(self.world_size)
            server.settimeout(CONNECT_TIMEOUT_S)
            try:
                while len(self.peers) < self.world_size - 1:
                    conn, _ = server.accept()
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.peers[int(_recv(conn))] = conn
            except TimeoutError as err:
                raise UsageError(f"{self.label}: {len(self.peers) + 1} of {self.world_size} workers connected to "
                                 f"port {port} within {CONNECT_TIMEOUT_S:.0f} s") from err
            finally:
                server.close()
            return
        while True:
            try:
                self.hub = socket.create_connection((host, port), timeout=5.0)
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise UsageError(f"{self.label}: worker {self.rank} cannot reach worker 0 at {host}:{port}: "
                                     f"{err}") from err
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

    def stream_rate(self, sender: int, seconds: float) -> float | None:
        """Collective (every worker calls it): worker ``sender`` streams bytes to worker 0 for ``seconds``; worker 0
        returns the rate the stream's second half arrived at (bytes/s, ``steady_rate``), the others None."""
        if self.world_size == 1 or sender == 0 or self.rank not in (0, sender):
            return None
        if self.rank == sender:
            if self.hub is None:
                raise ConnectionError(f"{self.label}: worker {self.rank} is not connected to worker 0")
            frame = _HEADER.pack(STREAM_CHUNK) + bytes(STREAM_CHUNK)
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                self.hub.sendall(frame)
            self.hub.sendall(_HEADER.pack(0))
            _recv(self.hub)  # worker 0 has read it all: the next stream starts on an empty link
            return None
        sock, marks, got = self.peers[sender], [], 0
        while True:
            (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
            if size == 0:
                break
            if size > STREAM_CHUNK:
                raise ConnectionError(f"stream frame of {size} bytes: larger than {STREAM_CHUNK}")
            _recv_exact(sock, size)
            got += size
            marks.append((time.monotonic(), got))
        _send(sock, "read")
        return steady_rate(marks)

    def timed_allreduce(self, nbytes: int, name: str, clock: Clock) -> float:
        """Not measured here (see the module docstring): the recorder leaves the probe out."""
        return 0.0


