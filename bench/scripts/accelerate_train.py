"""An unmodified Hugging Face Accelerate training loop (it never imports dpro), for benches: the shape of
Accelerate's examples (``Accelerator``, ``prepare``, ``accelerator.backward``) around a small MLP classifier on
random data, gloo on CPU. Needs ``pip install accelerate`` in the torch venv (not part of ``make venv``).
``dpro-launch -np 2 --auto python bench/scripts/accelerate_train.py --steps 80``.
"""

import argparse
import contextlib

import torch
from accelerate import Accelerator
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--depth", type=int, default=6)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--micro-batches", type=int, default=1,
                    help="each batch as K chunks, gradients synchronised after the last (what dpro's micro_batches "
                         "what-if prices; a plain loop does it in its own code)")
args = parser.parse_args()

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
layers: list[nn.Module] = [nn.Linear(256, args.width), nn.ReLU()]
for _ in range(args.depth - 1):
    layers += [nn.Linear(args.width, args.width), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(args.width, 10))
data = torch.utils.data.TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))
loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
step = 0
while step < args.steps:
    for x, y in loader:
        chunks = list(zip(x.chunk(args.micro_batches), y.chunk(args.micro_batches), strict=True))
        for k, (xs, ys) in enumerate(chunks):
            last = k == len(chunks) - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                loss = nn.functional.cross_entropy(model(xs), ys) / len(chunks)
                accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == args.steps:
            break
accelerator.print(f"done {step} steps, loss {loss.item():.3f}")
accelerator.end_training()
