"""An unmodified Horovod training script of a small conv1d net (it never imports dpro).

`dpro-launch --profile 10:30 -np 2 -H localhost:2 --gloo python conv1d_hvd.py` records it.
Options: --steps N; --channels C; --batch B; --length L.
"""

import argparse

import horovod.torch as hvd
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--channels", type=int, default=64)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--length", type=int, default=256)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)


class Conv1dNet(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(8, channels, 5, padding=2), nn.ReLU(),
            nn.Conv1d(channels, channels, 5, padding=2), nn.ReLU(),
            nn.Conv1d(channels, 2 * channels, 5, padding=2, stride=2), nn.ReLU(),
            nn.Conv1d(2 * channels, 2 * channels, 3, padding=1), nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Sequential(nn.Linear(2 * channels, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features(x)).flatten(1))


model = Conv1dNet(args.channels)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

gen = torch.Generator().manual_seed(hvd.rank())
for _ in range(args.steps):
    x = torch.randn(args.batch, 8, args.length, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
hvd.shutdown()
