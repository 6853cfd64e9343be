"""An unmodified FSDP2 training script (it never imports dpro), for the benches: a small transformer encoder (token
embedding, encoder layers, a classifier head), each encoder layer a ``fully_shard`` unit, then the root; AdamW,
gloo on CPU.

    dpro-launch -np 2 --profile 5:15 python bench/scripts/fsdp_train.py [--layers 4] [--reshard 0|1|default]
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--dim", type=int, default=256)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=32)
parser.add_argument("--reshard", choices=("0", "1", "default"), default="default")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4000, args.dim)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(args.dim, 4, 2 * args.dim, batch_first=True)
                                    for _ in range(args.layers))
        self.head = nn.Linear(args.dim, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


model = Encoder()
given = {} if args.reshard == "default" else {"reshard_after_forward": args.reshard == "1"}
for layer in model.layers:
    fully_shard(layer, **given)
fully_shard(model, **given)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(dist.get_rank())
began = None
for step in range(args.steps):
    if step == 5:
        began = time.perf_counter()
    tokens = torch.randint(0, 4000, (args.batch, args.seq), generator=gen)
    labels = torch.randint(0, 5, (args.batch,), generator=gen)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(tokens), labels).backward()
    optimizer.step()
if dist.get_rank() == 0 and began is not None:
    print(f"fsdp_train: {1000 * (time.perf_counter() - began) / (args.steps - 5):.2f} ms/step", flush=True)
dist.destroy_process_group()
