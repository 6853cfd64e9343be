"""An unmodified Horovod training script (it never imports dpro), for benches: an embedding + GRU + MLP
classifier with Adam. `dpro-launch -np 2 -H localhost:2 --gloo --profile 10:30 python bench/scripts/hvd_train.py`.
"""

import argparse

import horovod.torch as hvd
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--vocab", type=int, default=8000)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)


class TextNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, 64)
        self.rnn = nn.GRU(64, args.hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out[:, -1])


model = TextNet()
optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(hvd.rank())
for _ in range(args.steps):
    tokens, labels = torch.randint(0, args.vocab, (16, 32), generator=gen), torch.randint(0, 5, (16,), generator=gen)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(tokens), labels).backward()
    optimizer.step()
hvd.shutdown()
