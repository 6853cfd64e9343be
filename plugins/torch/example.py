"""The built-in example job: DDP training of a bundled model on synthetic data, profiled by dpro.

Run it under torchrun (any world size; gloo on CPU, nccl on CUDA)::

    torchrun --nproc-per-node 2 -m dpro.plugins.torch.example --model transformer --steps 30 --profile 10:20

or as a single process without torchrun. Rank 0 prints the run directory when it is done.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dpro.errors import UsageError
from dpro.plugins.torch.apply import apply, ddp_kwargs, load_config
from dpro.plugins.torch.models import MODELS, get_example
from dpro.plugins.torch.profiler import Profiler
from dpro.record.protocol import parse_window

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dpro.plugins.torch.example", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="transformer")
    parser.add_argument("--steps", type=int, default=30, help="training iterations in all")
    parser.add_argument("--profile", default="10:20",
                        help="iterations to record, START:STOP or START:STOP:BLOCK (default 10:20)")
    parser.add_argument("--run-dir", default=None, help="run directory (default: a new ./dpro-runs/<timestamp>)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--no-profile", action="store_true", help="train without dpro (for comparison)")
    parser.add_argument("--config", default=None,
                        help="a dpro config.json to apply (default: $DPRO_CONFIG when set)")
    return parser


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (if any); gloo on CPU, nccl on CUDA."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cpu")
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> Path | None:
    """Train the example model; return the run directory (None when not profiled)."""
    window = parse_window(args.profile).steps
    example = get_example(args.model)
    torch.manual_seed(0)
    model = example.build().to(device)
    ddp_args = {"bucket_cap_mb": args.bucket_cap_mb}
    config = load_config(args.config, model=model, world_size=world)
    if config is not None:
        model = apply(model, config)            # recompute wrappers, before DDP wraps the model
        ddp_args.update(ddp_kwargs(config, model=model))
    if world > 1:
        model = DistributedDataParallel(model, **ddp_args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(rank)
    batch_size = args.batch_size or example.batch_size

    def train_step() -> None:
        x, y = example.batch(batch_size, gen)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    if args.no_profile:
        for _ in range(args.steps):
            train_step()
        return None
    with Profiler(model, optimizer, run_dir=args.run_dir, steps=window, total_steps=args.steps) as prof:
        for _ in range(args.steps):
            train_step()
            prof.step()
    return prof.run_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_window(args.profile)
    except UsageError as err:
        parser.error(f"--profile {err}")
    rank, world, device = setup_distributed()
    began = time.monotonic()
    run_dir = train(args, rank, world, device)
    gc.collect()  # free the DDP model before the process group: gloo can abort if it outlives it
    if rank == 0:
        print(f"[dpro example] {args.model}: {args.steps} steps on {world} rank(s) in {time.monotonic() - began:.1f} s")
        if run_dir is not None:
            print(f"[dpro example] run directory: {run_dir}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
