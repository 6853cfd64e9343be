"""An unmodified DDP training script: it never imports dpro. `dpro-launch -np 2 python plain_ddp.py` records it.

Options: --steps N; --width W (hidden size); --accumulate K (K micro-batches per step, the forwards and
backwards of all but the last inside DDP's no_sync); --crash-rank R --crash-step S (that rank dies with status 3 at
that step, like a killed process); --print-env (each rank prints its torch.distributed environment);
--tag T (ignored: lets a test find its own processes); --slower-with-config MS (each step sleeps MS when a dpro
config is applied, $DPRO_CONFIG: a config that measures slower).
"""

import argparse
import contextlib
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--crash-rank", type=int, default=-1)
parser.add_argument("--crash-step", type=int, default=-1)
parser.add_argument("--print-env", action="store_true")
parser.add_argument("--tag", default="")
parser.add_argument("--slower-with-config", type=float, default=0.0)
parser.add_argument("--find-unused", action="store_true", help="DistributedDataParallel(find_unused_parameters=True)")
parser.add_argument("--unused-layer", action="store_true", help="a layer whose parameters never get a gradient")
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
if args.print_env:
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS")
    print("ENV " + " ".join(f"{n}={os.environ.get(n)}" for n in names), flush=True)


class WithSpare(nn.Module):
    """A model with a layer registered and never called: its parameters get no gradient."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.spare = body, nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def train() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                        nn.Linear(args.width, 10))
    if args.unused_layer:
        net = WithSpare(net)
    model = DistributedDataParallel(net, find_unused_parameters=args.find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        if rank == args.crash_rank and step == args.crash_step:
            os._exit(3)
        if args.slower_with_config and os.environ.get("DPRO_CONFIG"):
            time.sleep(args.slower_with_config / 1000.0)
        opt.zero_grad()
        for k in range(args.accumulate):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            with contextlib.nullcontext() if k == args.accumulate - 1 else model.no_sync():
                (nn.functional.cross_entropy(model(x), y) / args.accumulate).backward()
        opt.step()


train()
gc.collect()  # free the DDP model before the process group (gloo can abort at exit otherwise)
dist.barrier()
dist.destroy_process_group()
