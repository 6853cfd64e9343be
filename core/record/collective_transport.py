"""The recording protocol's ``Transport`` over a framework's collectives alone, for engines with no point-to-point
messages: texts as byte arrays, a ping as three broadcasts, the probes as blocking allreduces. A plugin gives it
its framework's collectives (``Collectives``: numpy arrays in and out), so the protocol is written once for every
framework such an engine runs on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from dpro.record.protocol import Clock

__all__ = ["GATHER_BYTES", "TEXT_BYTES", "CollectiveTransport", "Collectives", "decode_text", "encode_text"]

TEXT_BYTES = 4096   # a broadcast text (a run directory, an error) is cut to this
GATHER_BYTES = 256  # each rank's gathered text (a host name, a claim) is cut to this


def encode_text(text: str, size: int) -> np.ndarray:
    """``text`` UTF-8 encoded into a zero-padded uint8 array of ``size`` bytes (cut if longer)."""
    raw = text.encode()[:size]
    out = np.zeros(size, dtype=np.uint8)
    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def decode_text(row: np.ndarray) -> str:
    return bytes(np.asarray(row, dtype=np.uint8).tobytes()).rstrip(b"\0").decode(errors="replace")


class Collectives(Protocol):
    """A framework's collectives over its process group, on numpy arrays (one object per process)."""

    rank: int
    world_size: int
    backend: str

    def broadcast(self, data: np.ndarray, root: int, name: str) -> np.ndarray:
        """``root``'s ``data`` on every rank."""

    def allgather(self, data: np.ndarray, name: str) -> np.ndarray:
        """Every rank's ``data`` (one row each), stacked in rank order."""

    def barrier(self) -> None:
        """Wait until every rank is here."""

    def allreduce(self, nbytes: int, name: str) -> None:
        """A blocking sum of ``nbytes`` of float32 zeros (the probes' allreduce)."""

    # optional: allreduce_during(nbytes, name, compute, clock) -> (compute µs, µs the allreduce ran on after it),
    # ``compute`` run while an allreduce of ``nbytes`` is in flight (the interference probe needs it);
    # allreduce_under(nbytes, name, compute | None, clock) -> µs from its launch to its end, ``compute`` run over and
    # over meanwhile (the transfer probe needs it)


class CollectiveTransport:
    """``dpro.record.protocol.Transport`` over ``collectives``."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size
        self.backend = collectives.backend

    def broadcast_text(self, text: str, root: int = 0) -> str:
        sent = encode_text(text if self.rank == root else "", TEXT_BYTES)
        return decode_text(self.collectives.broadcast(sent, root, "dpro.text"))

    def gather_texts(self, text: str) -> list[str]:
        rows = self.collectives.allgather(encode_text(text, GATHER_BYTES)[None, :], "dpro.texts")
        return [decode_text(row) for row in rows]

    def barrier(self) -> None:
        self.collectives.barrier()

    def ping(self, peer: int, clock: Clock) -> list[float] | None:
        """Rank 0 broadcasts at t0, ``peer`` reads t1 when it arrives; ``peer`` broadcasts, rank 0 reads t3; a third
        broadcast carries t1 to rank 0. Each broadcast may wait for the engine's next background cycle, so round
        trips are long; alignment keeps the shortest."""
        zero = np.zeros(1, dtype=np.float64)
        t0 = clock.now()
        self.collectives.broadcast(zero, 0, f"dpro.clock.{peer}.a")
        t1 = clock.now()
        self.collectives.broadcast(zero, peer, f"dpro.clock.{peer}.b")
        t3 = clock.now()
        times = self.collectives.broadcast(np.array([t1, t1], dtype=np.float64), peer, f"dpro.clock.{peer}.c")
        if self.rank != 0:
            return None
        return [t0, float(times[0]), float(times[1]), t3]

    @property
    def overlapped_compute(self) -> Callable[[int, str, Callable[[], None], Clock], tuple[float, float]] | None:
        """The interference probe's exchange when the collectives can leave an allreduce in flight; None when
        they cannot (``dpro.record.protocol.interference_probe`` then probes nothing)."""
        during = getattr(self.collectives, "allreduce_during", None)
        if during is None:
            return None

        def run(nbytes: int, name: str, compute: Callable[[], None], clock: Clock) -> tuple[float, float]:
            self.collectives.barrier()
            return during(nbytes, name, compute, clock)

        return run

    @property
    def allreduce_under(self) -> Callable[[int, str, Callable[[], None] | None, Clock], float] | None:
        """The transfer probe's exchange (``dpro.record.protocol.transfer_probe``) when the collectives can leave an
        allreduce in flight; None when they cannot."""
        under = getattr(self.collectives, "allreduce_under", None)
        if under is None:
            return None

        def run(nbytes: int, name: str, compute: Callable[[], None] | None, clock: Clock) -> float:
            self.collectives.barrier()
            return under(nbytes, name, compute, clock)

        return run

    def timed_allreduce(self, nbytes: int, name: str, clock: Clock) -> float:
        """Includes waiting for the engine's cycle; an engine timeline's allreduce phases of these tensors
        (``dpro.probe.*``) replace the samples at load time when the run has one."""
        self.collectives.barrier()
        t0 = clock.now()
        self.collectives.allreduce(nbytes, name)
        return clock.now() - t0
