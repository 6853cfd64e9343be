"""An unmodified Horovod training script: it never imports dpro.
`dpro-launch -np 2 -H localhost:2 --gloo python plain_hvd.py` records it.

Options: --steps N; --width W (hidden size); --no-names (no named_parameters= for Horovod).
Rank 0 prints "HVD size=N fusion=... cycle=..." (Horovod's knobs as the process sees them).
"""

import argparse
import os

import horovod.torch as hvd
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--no-names", action="store_true")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


model = Net(args.width)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
named = None if args.no_names else model.named_parameters()
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
if hvd.rank() == 0:
    print(f"HVD size={hvd.size()} fusion={os.environ.get('HOROVOD_FUSION_THRESHOLD')} "
          f"cycle={os.environ.get('HOROVOD_CYCLE_TIME')}", flush=True)

gen = torch.Generator().manual_seed(hvd.rank())
for _ in range(args.steps):
    x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
hvd.shutdown()
