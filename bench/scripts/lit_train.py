"""An unmodified Lightning training script (it never imports dpro), for benches: `dpro-launch -np 2 -H localhost:2
--profile 10:30 python bench/scripts/lit_train.py` records it.

--model mlp (3 Linear layers) | conv (a small 2-d conv net); --optimization automatic (Lightning's default:
optimizer.step(closure)) | manual (manual_backward + opt.step); --accumulate K batches per optimizer step.
"""

import argparse
import gc
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
parser.add_argument("--model", choices=["mlp", "conv"], default="mlp")
parser.add_argument("--optimization", choices=["automatic", "manual"], default="automatic")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--batch", type=int, default=64)
args = parser.parse_args()


def build() -> tuple[nn.Module, tuple[int, ...]]:
    if args.model == "mlp":
        return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)), (128,)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10)), (3, 32, 32)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net, _ = build()
        self.automatic_optimization = args.optimization == "automatic"

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        if (batch_idx + 1) % args.accumulate:
            with self.trainer.strategy.model.no_sync():
                self.manual_backward(loss / args.accumulate)
        else:
            self.manual_backward(loss / args.accumulate)
            opt.step()
            opt.zero_grad()
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    _, shape = build()
    n = args.batch * args.steps * args.accumulate
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, *shape, generator=gen), torch.randint(0, 10, (n,), generator=gen))
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0,
                         accumulate_grad_batches=args.accumulate if args.optimization == "automatic" else 1)
    trainer.fit(Classifier(), DataLoader(data, batch_size=args.batch))
    gc.collect()  # free the DDP model before the process group (gloo can abort at exit otherwise)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
