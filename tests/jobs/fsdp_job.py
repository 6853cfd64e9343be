"""An unmodified FSDP2 training script (it never imports dpro): blocks of linear layers, each block a unit of
``fully_shard``, then the whole model (the root), SGD, gloo on CPU.

    dpro-launch -np 2 --profile 3:9 python fsdp_job.py [--steps 12] [--reshard 0|1|default]
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--depth", type=int, default=3)
parser.add_argument("--reshard", choices=("0", "1", "default"), default="default")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.depth)],
                      nn.Linear(args.width, 10))
given = {} if args.reshard == "default" else {"reshard_after_forward": args.reshard == "1"}
for block in model[:-1]:
    fully_shard(block, **given)
fully_shard(model, **given)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, args.width), torch.randint(0, 10, (16,))
for _ in range(args.steps):
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
dist.destroy_process_group()
