"""dpro's TCP side channel (``dpro.record.socket_transport``): the link probe's stream between two real workers on
loopback, and the rate read from a stream's arrivals."""

from __future__ import annotations

import socket
import threading

import pytest

from dpro.record.socket_transport import SocketTransport, steady_rate


def test_the_rate_is_read_over_the_second_half_of_the_arrivals():
    # 1 MB at once (the link's queues let it through), then 1 MB every 10 ms: 100 MB/s after the start
    marks = [(0.0, 1_000_000)] + [(0.01 * i, 1_000_000 * (i + 1)) for i in range(1, 11)]
    assert steady_rate(marks) == pytest.approx(100e6)
    assert steady_rate(marks[:3]) is None  # too few arrivals to tell
    assert steady_rate([(1.0, 10), (1.0, 20), (1.0, 30), (1.0, 40)]) is None  # no time passed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_streams_to_worker_0_and_only_worker_0_reads_the_rate():
    port, out = _free_port(), {}

    def worker(rank: int) -> None:
        transport = SocketTransport.connect(rank, 3, "127.0.0.1", port)
        try:
            out[rank] = [transport.stream_rate(2, 0.1), transport.stream_rate(1, 0.1)]
            transport.barrier()  # the side channel still carries messages after the streams
        finally:
            transport.close()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(out) == [0, 1, 2]
    assert all(rate is not None and rate > 1e6 for rate in out[0])  # loopback carries far more than 1 MB/s
    assert out[1] == [None, None] and out[2] == [None, None]
    assert SocketTransport(rank=0, world_size=1).stream_rate(1, 0.1) is None  # one worker: nothing to measure
