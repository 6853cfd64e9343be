"""A ``transformers.Trainer`` job with dpro's callback: a tiny BERT classifier from a ``BertConfig`` (no download) on
random tokens, gloo DDP on CPU.

    torchrun --nproc-per-node 2 hf_trainer_job.py RUN_DIR [--steps 12] [--window 3:9]
"""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from dpro.plugins.torch.transformers_callback import DproTrainerCallback

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--window", default="3:9")
args = parser.parse_args()
start, stop = (int(v) for v in args.window.split(":"))


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 500, (count, 32), generator=g)
        self.labels = torch.randint(0, 2, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


config = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    max_position_embeddings=32)
training = TrainingArguments(output_dir=f"{args.run_dir}-out", max_steps=args.steps, per_device_train_batch_size=8,
                             use_cpu=True, ddp_backend="gloo", logging_steps=1000, save_strategy="no", report_to=[],
                             dataloader_num_workers=0, disable_tqdm=True)
callback = DproTrainerCallback(run_dir=args.run_dir, steps=range(start, stop))
Trainer(model=BertForSequenceClassification(config), args=training, train_dataset=RandomTokens(512),
        callbacks=[callback]).train()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # gloo can abort at exit otherwise (torch 2.13)
