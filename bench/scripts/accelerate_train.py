"""An unmodified Hugging Face Accelerate training loop (it never imports dpro), for benches: the shape of
Accelerate's examples (``Accelerator``, ``prepare``, ``accelerator.backward``) around a small MLP classifier on
random data, gloo on CPU. Needs ``pip install accelerate`` in the torch venv (not part of ``make venv``).
``dpro-launch -np 2 --auto python bench/scripts/accelerate_train.py --steps 80``.
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--depth", type=int, default=6)
parser.add_argument("--batch", type=int, default=32)
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
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == args.steps:
            break
accelerator.print(f"done {step} steps, loss {loss.item():.3f}")
accelerator.end_training()
