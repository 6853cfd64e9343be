"""A 2-rank gloo DDP job profiled with torch.profiler (CPU activities), no dpro: one Kineto trace per rank.

--model mlp (the tests') or cnn (bench/kineto_whatif.py's: 9 MB of gradients); --bucket-cap-mb sets DDP's bucket
size, --record-shapes torch.profiler's record_shapes (the gradients' sizes a bucket what-if needs)."""

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
parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
parser.add_argument("--record-shapes", action="store_true", help="torch.profiler's record_shapes (gradient sizes)")
parser.add_argument("--active", type=int, default=5, help="profiled steps")
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
gen = torch.Generator().manual_seed(rank)
if args.model == "mlp":
    module = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    batch = lambda: (torch.randn(32, 512, generator=gen), torch.randint(0, 10, (32,), generator=gen))  # noqa: E731
else:
    module = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    batch = lambda: (torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen))  # noqa: E731
net = DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb)
opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9 if args.model == "cnn" else 0.0)
with profile(activities=[ProfilerActivity.CPU], record_shapes=args.record_shapes,
             schedule=schedule(wait=1, warmup=2, active=args.active),
             on_trace_ready=lambda p: p.export_chrome_trace(f"{args.out}/rank{rank}.pt.trace.json")) as prof:
    for _ in range(3 + args.active):
        x, y = batch()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        prof.step()
del net, module, opt, prof  # DDP goes before the process group (gloo aborts at exit otherwise)
gc.collect()
dist.barrier()
dist.destroy_process_group()
