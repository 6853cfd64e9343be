"""torch.distributed as a ``dpro.record.protocol.Transport``: what the recording protocol exchanges between ranks.

Texts travel as fixed-size byte tensors (never pickled); on NCCL the tensors live on the current CUDA device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dpro.record.collective_transport import GATHER_BYTES, TEXT_BYTES, decode_text, encode_text
from dpro.record.protocol import Clock

__all__ = ["TorchDistTransport", "bytes_tensor", "tensor_text"]


def bytes_tensor(text: str, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``text`` UTF-8 encoded into a zero-padded uint8 tensor of ``size`` bytes (cut if longer)."""
    return torch.from_numpy(encode_text(text, size)).to(device)


def tensor_text(buf: torch.Tensor) -> str:
    return decode_text(buf.cpu().numpy())


class TorchDistTransport:
    """The default process group of an initialized torch.distributed job."""

    def __init__(self) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.cuda = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")

    def broadcast_text(self, text: str, root: int = 0) -> str:
        buf = bytes_tensor(text if self.rank == root else "", TEXT_BYTES, self.device)
        dist.broadcast(buf, src=root)
        return tensor_text(buf)

    def gather_texts(self, text: str) -> list[str]:
        mine = bytes_tensor(text, GATHER_BYTES, self.device)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [tensor_text(t) for t in out]

    def barrier(self) -> None:
        dist.barrier()

    def ping(self, peer: int, clock: Clock) -> list[float] | None:
        if self.rank == 0:
            t0 = clock.now()
            dist.send(torch.zeros(2, dtype=torch.float64, device=self.device), dst=peer)
            answer = torch.zeros(2, dtype=torch.float64, device=self.device)
            dist.recv(answer, src=peer)
            t3 = clock.now()
            t1, t2 = answer.cpu().tolist()
            return [t0, t1, t2, t3]
        if self.rank == peer:
            dist.recv(torch.zeros(2, dtype=torch.float64, device=self.device), src=0)
            t1 = clock.now()
            dist.send(torch.tensor([t1, clock.now()], dtype=torch.float64, device=self.device), dst=0)
        return None

    def overlapped_compute(self, nbytes: int, name: str, compute: Callable[[], None],
                           clock: Clock) -> tuple[float, float]:
        """Run ``compute`` while an allreduce of ``nbytes`` is in flight: (compute µs, µs the allreduce ran on
        after it)."""
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=self.device)
        dist.barrier()
        work = dist.all_reduce(tensor, async_op=True)
        t0 = clock.now()
        compute()
        t1 = clock.now()
        work.wait()
        if self.cuda:
            torch.cuda.synchronize()
        return t1 - t0, clock.now() - t1

    def allreduce_under(self, nbytes: int, name: str, compute: Callable[[], None] | None, clock: Clock) -> float:
        """µs from the launch of an allreduce of ``nbytes`` to its end, with ``compute`` run over and over meanwhile
        (None: waited for alone); every rank meets at a barrier first."""
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=self.device)
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
        work = dist.all_reduce(tensor, async_op=True)
        t0 = clock.now()
        ended: list[float] = []
        if compute is not None:
            # noted by the thread that completes it: ``compute`` may be a long pass, and the end falls inside it
            work.get_future().then(lambda _: ended.append(clock.now()))
            while not work.is_completed():
                compute()
        work.wait()
        if self.cuda:
            torch.cuda.synchronize()
        return (ended[0] if ended and not self.cuda else clock.now()) - t0

    def timed_allreduce(self, nbytes: int, name: str, clock: Clock) -> float:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=self.device)
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
        t0 = clock.now()
        dist.all_reduce(tensor)
        if self.cuda:
            torch.cuda.synchronize()
        return clock.now() - t0
