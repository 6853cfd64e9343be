"""An unmodified Lightning DDP script on CPU (it never imports dpro); --package picks lightning.pytorch or
pytorch_lightning. Started by dpro-launch, the Trainer gets dpro's DproCallback."""

import argparse
import gc
import importlib
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--package", default="lightning.pytorch")
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()
pl = importlib.import_module(args.package)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 16 * args.steps * 2
    x, y = torch.randn(n, 32, generator=gen), torch.randint(0, 4, (n,), generator=gen)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(), DataLoader(TensorDataset(x, y), batch_size=16))


if __name__ == "__main__":
    main()
    # free the DDP model before the process group: gloo (torch 2.13) can abort at exit when a DDP model
    # outlives its process group; a careful script does this whether or not dpro is attached
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
