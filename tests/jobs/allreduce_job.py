"""Time gloo all_reduce: per size, a warm-up then ``--iters`` timed calls; rank 0 prints one JSON line per size.

Reads the torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), e.g. from
``dpro.testbed.torch_rank_env``. Output: {"mb": 8.0, "median_s": 0.07, "times_s": [...]}.
"""

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--sizes-mb", default="8", help="comma-separated tensor sizes in MB (float32)")
parser.add_argument("--iters", type=int, default=5)
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
for mb in (float(s) for s in args.sizes_mb.split(",")):
    tensor = torch.ones(int(mb * 1e6) // 4)
    dist.all_reduce(tensor)  # warm-up: connects the pairs, allocates buffers
    times = []
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"mb": mb, "median_s": statistics.median(times), "times_s": times}), flush=True)
dist.barrier()
dist.destroy_process_group()
