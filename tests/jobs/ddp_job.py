"""A DDP training job for the tests: a bundled model, dpro's Profiler, an optional dpro config, an optional crash."""

import argparse
import contextlib
import datetime
import gc
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel

from dpro.plugins.torch import Profiler, apply, ddp_kwargs, load_config
from dpro.plugins.torch.apply import register_compression
from dpro.plugins.torch.models import get_example

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mlp")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--profile", default="2:6")
parser.add_argument("--run-dir", required=True)
parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="DDP's bucket_cap_mb; 0: not given (DDP's default, with its smaller first bucket)")
parser.add_argument("--config", default=None, help="a dpro config.json to apply")
parser.add_argument("--force", action="store_true", help="apply a config made for another job")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step, no_sync on all but the last")
parser.add_argument("--no-sync", choices=("pass", "backward"), default="pass",
                    help="what no_sync wraps: the forward and backward (DDP then skips the allreduce) or only the "
                         "backward (a common loop; DDP still allreduces every pass)")
parser.add_argument("--reuse", action="store_true",
                    help="a model whose hidden layer runs twice per forward, the second time checkpointed")
parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model (the Profiler is handed that)")
parser.add_argument("--params-digest", default=None,
                    help="rank 0 writes here, as JSON, a sha256 of each parameter and buffer after training")
parser.add_argument("--crash-rank", type=int, default=-1)
parser.add_argument("--crash-step", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()


class Reused(torch.nn.Module):
    """A hidden layer called twice in one forward, its second call under activation checkpointing."""

    def __init__(self, net: torch.nn.Sequential) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = net[0], torch.nn.Linear(net[0].out_features, net[0].out_features), net[1:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(torch.relu(self.inp(x))))
        h = torch.utils.checkpoint.checkpoint(self.hidden_relu, h, use_reentrant=False)
        return self.out(h)

    def hidden_relu(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.hidden(h))  # relu keeps its output, which the backward recomputes


def train() -> None:
    example = get_example(args.model)
    torch.manual_seed(0)
    net = Reused(example.build()) if args.reuse else example.build()
    config = load_config(args.config, model=net, force=args.force) if args.config else None
    kwargs = {"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb > 0 else {}
    if config is not None:
        net = apply(net, config)
        kwargs.update(ddp_kwargs(config, model=net))
    model = DistributedDataParallel(net, **kwargs)
    if config is not None:
        register_compression(model, config)  # before the Profiler: DDP takes one comm hook
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.compile:
        model = torch.compile(model)
    gen = torch.Generator().manual_seed(rank)
    start, stop = (int(v) for v in args.profile.split(":"))
    with Profiler(model, opt, run_dir=args.run_dir, steps=range(start, stop), total_steps=args.steps) as prof:
        for step in range(args.steps):
            if rank == args.crash_rank and step == args.crash_step:
                os._exit(3)  # die like a killed process: no cleanup, no exception
            x, y = example.batch(example.batch_size * args.accumulate, gen)
            opt.zero_grad()
            for k, (xs, ys) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate), strict=True)):
                last = k == args.accumulate - 1
                with contextlib.nullcontext() if last or args.no_sync == "backward" else model.no_sync():
                    loss = torch.nn.functional.cross_entropy(model(xs), ys) / args.accumulate
                with contextlib.nullcontext() if last else model.no_sync():
                    loss.backward()
            opt.step()
            prof.step()
    if args.params_digest and rank == 0:
        state = {n: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
                 for n, t in [*net.named_parameters(), *net.named_buffers()]}
        with open(args.params_digest, "w") as f:
            json.dump(state, f)


train()
gc.collect()  # free the DDP model before the process group: gloo can abort if it outlives it
dist.barrier()
dist.destroy_process_group()
