"""An unmodified Hugging Face ``transformers.Trainer`` script (it never imports dpro), for benches: a small BERT
sequence classifier built from a ``BertConfig`` (no download) on random tokens, gloo DDP on CPU.
Needs ``pip install transformers accelerate`` in the torch venv (not part of ``make venv``).
``dpro-launch -np 2 --auto python bench/scripts/hf_trainer.py --steps 80``.
"""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--out", default="/tmp/hf-trainer-out")
args = parser.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, seq), generator=g)
        self.labels = torch.randint(0, 2, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


config = BertConfig(vocab_size=8000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                    num_attention_heads=4, intermediate_size=4 * args.hidden, max_position_embeddings=args.seq)
model = BertForSequenceClassification(config)
training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                             use_cpu=True, ddp_backend="gloo", logging_steps=1000, save_strategy="no",
                             report_to=[], dataloader_num_workers=0, disable_tqdm=True)
Trainer(model=model, args=training, train_dataset=RandomTokens(4096, args.seq, config.vocab_size)).train()
if torch.distributed.is_initialized():
    # without it, a rank sometimes aborts at exit ("terminate called without an active exception", with or
    # without dpro): gloo's threads outlive the interpreter's teardown
    torch.distributed.destroy_process_group()
