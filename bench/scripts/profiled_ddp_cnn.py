"""A 2-rank gloo DDP job of a small CNN profiled with torch.profiler (CPU activities, shapes recorded), no dpro: one
Kineto trace per rank in --out. For bench/kineto_whatif.py: --bucket-cap-mb sets DDP's bucket size."""

import argparse
import datetime
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, schedule

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="folder for rank<r>.pt.trace.json")
parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
parser.add_argument("--active", type=int, default=6, help="profiled steps")
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
net = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(64 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
model = DistributedDataParallel(net, bucket_cap_mb=args.bucket_cap_mb)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
gen = torch.Generator().manual_seed(rank)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
             schedule=schedule(wait=1, warmup=2, active=args.active),
             on_trace_ready=lambda p: p.export_chrome_trace(f"{args.out}/rank{rank}.pt.trace.json")) as prof:
    for _ in range(3 + args.active):
        x, y = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        prof.step()
del model, opt, prof  # DDP goes before the process group (gloo aborts at exit otherwise)
gc.collect()
dist.barrier()
dist.destroy_process_group()
