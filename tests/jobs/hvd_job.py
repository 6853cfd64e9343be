"""A Horovod training job for the tests and benchmarks: a bundled model, hvd.DistributedOptimizer,
recorded by dpro's record_horovod (optional), optional dpro config (tensor_groups -> groups=).

Run with ``horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/hvd_job.py --run-dir RUN``.
HOROVOD_TIMELINE, HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME come from the environment.
Prints one JSON line on rank 0: the mean step time (ms) of the steps after warm-up (the job's throughput), and the
wall-clock time (time.time()) when training started and when each step ended.
"""

import argparse
import json
import statistics
import time

import horovod.torch as hvd
import torch

from dpro.plugins.torch.models import get_example

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mlp")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--profile", default="3:7", help="steps to record, START:STOP[:BLOCK] ('' records nothing)")
parser.add_argument("--run-dir", default=None)
parser.add_argument("--config", default=None, help="a dpro config.json: its tensor_groups become groups=")
parser.add_argument("--warmup", type=int, default=3, help="steps left out of the printed mean")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
example = get_example(args.model)
torch.manual_seed(0)
model = example.build()
groups = None
if args.config:
    from dpro.config import read_config

    names = read_config(args.config).knobs.get("tensor_groups") or []
    params = dict(model.named_parameters())
    groups = [[params[n] for n in group] for group in names if len(group) > 1] or None
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), groups=groups)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(hvd.rank())
started = time.time()
times = []
ends = []


def one_step() -> None:
    x, y = example.batch(example.batch_size, gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


if args.profile:
    from dpro.plugins.torch.horovod import record_horovod
    from dpro.record.protocol import parse_window

    steps = parse_window(args.profile).steps
    with record_horovod(model, opt, run_dir=args.run_dir, steps=steps, total_steps=args.steps) as rec:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            one_step()
            rec.step()
            times.append(time.perf_counter() - t0)
            ends.append(time.time())
else:
    for _ in range(args.steps):
        t0 = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
        ends.append(time.time())

if hvd.rank() == 0:
    tail = times[args.warmup:] or times
    print(json.dumps({"step_ms": statistics.fmean(tail) * 1000, "steps": len(times), "started": started,
                      "step_ends": ends}), flush=True)
hvd.shutdown()
