"""A DDP script that records itself with dpro's Profiler (run_dir=None: a new directory under $DPRO_RUN_DIR,
or --run-dir). Under dpro-launch it must be recorded once, by its own Profiler."""

import argparse
import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpro.plugins.torch import Profiler

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--run-dir", default=None)
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def train() -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    with Profiler(model, opt, run_dir=args.run_dir, steps=range(2, 6), total_steps=args.steps) as prof:
        for _ in range(args.steps):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            prof.step()


train()
dist.barrier()
dist.destroy_process_group()
