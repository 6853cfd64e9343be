"""A Lightning DDP job on CPU with dpro; --package picks lightning.pytorch or pytorch_lightning.

--slot callback (DproCallback) or profiler (Trainer(profiler=DproProfiler(...)), whose summary rank 0 prints
after a "DPRO SUMMARY" line). --optimization automatic (Lightning's default: optimizer.step(closure) runs the
forward and backward) or manual (training_step calls manual_backward and opt.step); --accumulate K accumulates
K batches per step.
"""

import argparse
import gc
import importlib
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from dpro.plugins.torch.lightning import DproCallback, DproProfiler
from dpro.plugins.torch.models import get_example

parser = argparse.ArgumentParser()
parser.add_argument("--package", default="pytorch_lightning")
parser.add_argument("--model", default="mlp")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--profile", default="2:6")
parser.add_argument("--run-dir", required=True)
parser.add_argument("--slot", choices=["callback", "profiler"], default="callback")
parser.add_argument("--config", default=None, help="a dpro config.json for DproCallback to apply")
parser.add_argument("--optimization", choices=["automatic", "manual"], default="automatic")
parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
parser.add_argument("--val-every", type=int, default=0, help="run 2 validation batches every N training batches")
args = parser.parse_args()
pl = importlib.import_module(args.package)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = get_example(args.model).build()
        self.automatic_optimization = args.optimization == "automatic"

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        last = (batch_idx + 1) % args.accumulate == 0
        if last:
            self.manual_backward(loss / args.accumulate)
            opt.step()
            opt.zero_grad()
        else:
            with self.trainer.strategy.model.no_sync():  # DDP: no allreduce until the last micro-batch
                self.manual_backward(loss / args.accumulate)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    example = get_example(args.model)
    x, y = example.batch(example.batch_size * args.steps * args.accumulate, torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, y), batch_size=example.batch_size)
    start, stop = (int(v) for v in args.profile.split(":"))
    validation = {"val_check_interval": args.val_every, "limit_val_batches": 2, "num_sanity_val_steps": 0,
                  "check_val_every_n_epoch": None} if args.val_every else {"limit_val_batches": 0}
    trainer = pl.Trainer(
        **validation,
        accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, logger=False,
        accumulate_grad_batches=args.accumulate if args.optimization == "automatic" else 1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **slot(range(start, stop)),
    )
    trainer.fit(Module(), loader, val_dataloaders=loader if args.val_every else None)
    if args.slot == "profiler" and trainer.global_rank == 0:
        print("DPRO SUMMARY\n" + trainer.profiler.summary(), flush=True)


def slot(steps: range) -> dict:
    """The Trainer's arguments that put dpro in the slot asked for."""
    if args.slot == "profiler":
        run = Path(args.run_dir)
        return {"profiler": DproProfiler(dirpath=run.parent, filename=run.name, steps=steps, config=args.config)}
    return {"callbacks": [DproCallback(run_dir=args.run_dir, steps=steps, config=args.config)]}


if __name__ == "__main__":
    main()
    gc.collect()  # free the DDP model before the process group goes: gloo can abort at exit otherwise
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
