"""The baseline for compare_loops.py: a minimal hand-written accelerate loop.

Usage: ``python benchmarks/raw_loop.py --config RECIPE [KEY=VALUE ...]``, the same arguments as
``recipes/run.py``. The recipe is resolved by the framework's own config loader and the data is read
and tokenized by the framework's own ``load_splits`` and ``tokenize``, so the settings and the examples
are the framework's exactly; the loop itself is plain accelerate. It runs ``train.max_steps`` steps
(one epoch at most), then does the final work the framework does: one eval pass and save_pretrained.
"""

import argparse
import math
import sys
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the framework, from this clone

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
)

from framework.config import load_config  # noqa: E402
from framework.data import load_splits, tokenize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    t, o = cfg.train, cfg.optim
    if cfg.precision != "no" or not t.max_steps or t.gradient_accumulation_steps != 1 or t.max_grad_norm:
        sys.exit("this loop trains in fp32 for train.max_steps steps, without accumulation or clipping: "
                 "pass train.max_steps=N train.max_grad_norm=null (and the default precision: no)")

    # The seedable sampler is what the framework and Trainer both use: the same shuffle order for all three.
    accelerator = Accelerator(cpu=cfg.backend == "cpu",
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(cfg.seed)
    splits = load_splits(cfg.data, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        cfg.model.name_or_path, num_labels=len(splits.label_names),
        id2label=dict(enumerate(splits.label_names)), label2id={n: i for i, n in enumerate(splits.label_names)})
    train_ds = tokenize(splits.train, tokenizer, cfg.data)
    eval_ds = tokenize(splits.eval, tokenizer, cfg.data)

    collate = DataCollatorWithPadding(tokenizer)
    train_dl = DataLoader(train_ds, batch_size=t.batch_size, shuffle=True, drop_last=True, collate_fn=collate)
    eval_dl = DataLoader(eval_ds, batch_size=t.eval_batch_size or 2 * t.batch_size, collate_fn=collate)
    if len(train_dl) < t.max_steps:
        sys.exit(f"train.max_steps={t.max_steps} is more than one epoch ({len(train_dl)} steps)")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ], lr=o.lr)
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
            predictions, labels = accelerator.gather_for_metrics((model(**batch).logits.argmax(-1), batch["labels"]))
            correct += (predictions == labels).sum()
    accelerator.print(f"eval accuracy {correct.item() / len(eval_ds):.4f}")
    out = Path(cfg.output_dir) / "model"
    accelerator.unwrap_model(model).save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main()
