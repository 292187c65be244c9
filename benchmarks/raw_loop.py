"""The baseline for compare_loops.py: a minimal hand-written accelerate loop.

Usage: ``python benchmarks/raw_loop.py --config RECIPE [KEY=VALUE ...]``, the arguments of ``recipes/run.py``.
The settings come from the framework's config loader and the data from the framework's ``load_splits`` and
``tokenize`` (see common.py), so the examples are the framework's; the loop itself is plain accelerate. It
runs ``train.max_steps`` steps (one epoch at most), then does the framework's final work: one eval pass
and save_pretrained.
"""

import math
import sys
from itertools import islice
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, get_scheduler

from common import adamw, load_data_and_model, read_recipe


def main() -> None:
    cfg = read_recipe()
    t, o = cfg.train, cfg.optim
    # The seedable sampler is what the framework and Trainer use: the same shuffle order in all three.
    accelerator = Accelerator(cpu=cfg.backend == "cpu",
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    tokenizer, model, train_ds, eval_ds = load_data_and_model(cfg)

    collate = DataCollatorWithPadding(tokenizer)
    train_dl = DataLoader(train_ds, batch_size=t.batch_size, shuffle=True, drop_last=True, collate_fn=collate)
    eval_dl = DataLoader(eval_ds, batch_size=t.eval_batch_size or 2 * t.batch_size, collate_fn=collate)
    if len(train_dl) < t.max_steps:
        sys.exit(f"train.max_steps={t.max_steps} is more than one epoch ({len(train_dl)} steps)")
    optimizer = adamw(model, o, accelerator.device.type)
    scheduler = get_scheduler(o.scheduler, optimizer, num_warmup_steps=math.ceil(o.warmup_ratio * t.max_steps),
                              num_training_steps=t.max_steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)

    model.train()
    for batch in islice(train_dl, t.max_steps):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=accelerator.device)
    with torch.no_grad():
        for batch in eval_dl:
            predictions, targets = accelerator.gather_for_metrics((model(**batch).logits.argmax(-1), batch["labels"]))
            correct += (predictions == targets).sum()
    accelerator.print(f"eval accuracy {correct.item() / len(eval_ds):.4f}")
    out = Path(cfg.output_dir) / "model"
    accelerator.unwrap_model(model).save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main()
