"""A DDP training job for the tests: a bundled model, dpro's Profiler, an optional dpro config, an optional crash."""

import argparse
import datetime
import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dpro.plugins.torch import Profiler, apply, ddp_kwargs, load_config
from dpro.plugins.torch.apply import register_compression
from dpro.plugins.torch.models import get_example

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mlp")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--profile", default="2:6")
parser.add_argument("--run-dir", required=True)
parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
parser.add_argument("--config", default=None, help="a dpro config.json to apply")
parser.add_argument("--force", action="store_true", help="apply a config made for another job")
parser.add_argument("--crash-rank", type=int, default=-1)
parser.add_argument("--crash-step", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()


def train() -> None:
    example = get_example(args.model)
    torch.manual_seed(0)
    net = example.build()
    config = load_config(args.config, model=net, force=args.force) if args.config else None
    kwargs = {"bucket_cap_mb": args.bucket_cap_mb}
    if config is not None:
        net = apply(net, config)
        kwargs.update(ddp_kwargs(config, model=net))
    model = DistributedDataParallel(net, **kwargs)
    if config is not None:
        register_compression(model, config)  # before the Profiler: DDP takes one comm hook
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    start, stop = (int(v) for v in args.profile.split(":"))
    with Profiler(model, opt, run_dir=args.run_dir, steps=range(start, stop), total_steps=args.steps) as prof:
        for step in range(args.steps):
            if rank == args.crash_rank and step == args.crash_step:
                os._exit(3)  # die like a killed process: no cleanup, no exception
            x, y = example.batch(example.batch_size, gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            prof.step()


train()
gc.collect()  # free the DDP model before the process group: gloo can abort if it outlives it
dist.barrier()
dist.destroy_process_group()
