"""An unmodified DDP script with torch.compile (it never imports dpro).

Options: --steps N; --compile ddp (torch.compile(DDP(model)), the default), model (DDP(torch.compile(model))) or
block (one submodule compiled in place).
"""

import argparse
import datetime
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--compile", choices=("ddp", "model", "block"), default="ddp")
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()


def train() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    if args.compile == "block":
        net[2] = torch.compile(net[2])
    model = DistributedDataParallel(torch.compile(net) if args.compile == "model" else net)
    if args.compile == "ddp":
        model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


train()
gc.collect()
dist.barrier()
dist.destroy_process_group()
