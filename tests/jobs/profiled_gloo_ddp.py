"""A 2-rank gloo DDP job profiled with torch.profiler (CPU activities), no dpro: one Kineto trace per rank."""

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
parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
parser.add_argument("--record-shapes", action="store_true", help="torch.profiler's record_shapes (gradient sizes)")
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
net = DistributedDataParallel(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                            nn.Linear(1024, 10)), bucket_cap_mb=args.bucket_cap_mb)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
with profile(activities=[ProfilerActivity.CPU], record_shapes=args.record_shapes,
             schedule=schedule(wait=1, warmup=2, active=5),
             on_trace_ready=lambda p: p.export_chrome_trace(f"{args.out}/rank{rank}.pt.trace.json")) as prof:
    for _ in range(9):
        x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        prof.step()
del net, opt, prof  # DDP goes before the process group (gloo aborts at exit otherwise)
gc.collect()
dist.barrier()
dist.destroy_process_group()
