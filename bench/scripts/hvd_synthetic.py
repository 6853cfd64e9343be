"""An unmodified Horovod script in the manner of Horovod's synthetic PyTorch benchmark (it never imports dpro): a
small residual CNN on random images, SGD with momentum, hvd.DistributedOptimizer with its defaults.

    dpro-launch -np 2 -H localhost:2 --gloo --profile 10:25 python bench/scripts/hvd_synthetic.py
"""

import argparse

import horovod.torch as hvd
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--channels", type=int, default=32)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


c = args.channels
model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), Block(c), nn.MaxPool2d(2), Block(c),
                      nn.MaxPool2d(2), Block(c), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 512),
                      nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 100))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
images = torch.randn(args.batch, 3, 32, 32)
labels = torch.randint(0, 100, (args.batch,))
for _ in range(args.steps):
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
hvd.shutdown()
