"""The reference for compare_loops.py: ``transformers.Trainer`` set up to do the framework's work.

Usage: ``python benchmarks/trainer_loop.py --config RECIPE [KEY=VALUE ...]``, the same arguments as
``recipes/run.py``. Settings, data and tokenization come from the framework's config loader and
``load_splits``/``tokenize``, as in raw_loop.py. TrainingArguments mirror the recipe: per-device batch,
drop_last, AdamW (torch, not fused) with the same lr and decoupled weight decay on the same parameters,
linear schedule with the same warmup steps, fp32, the same seed (hence the same seedable shuffle).
Logging, saving and evaluation during training are off; after training it does the framework's final
work: one eval pass and save_pretrained.
"""

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the framework, from this clone

import numpy as np  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

from framework.config import load_config  # noqa: E402
from framework.data import load_splits, tokenize  # noqa: E402


def accuracy(prediction) -> dict:
    return {"accuracy": float(np.mean(prediction.predictions.argmax(-1) == prediction.label_ids))}


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

    # Same order as the framework: seed, data, tokenizer, model (the fresh head draws from the seeded RNG).
    set_seed(cfg.seed)
    splits = load_splits(cfg.data, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        cfg.model.name_or_path, num_labels=len(splits.label_names),
        id2label=dict(enumerate(splits.label_names)), label2id={n: i for i, n in enumerate(splits.label_names)})
    train_ds = tokenize(splits.train, tokenizer, cfg.data)
    eval_ds = tokenize(splits.eval, tokenizer, cfg.data)
    if len(train_ds) // t.batch_size < t.max_steps:
        sys.exit(f"train.max_steps={t.max_steps} is more than one epoch ({len(train_ds) // t.batch_size} steps)")

    training_args = TrainingArguments(
        output_dir=cfg.output_dir,
        use_cpu=cfg.backend == "cpu",
        seed=cfg.seed,
        per_device_train_batch_size=t.batch_size,
        per_device_eval_batch_size=t.eval_batch_size or 2 * t.batch_size,
        max_steps=t.max_steps,
        dataloader_drop_last=True,
        dataloader_pin_memory=False,  # the framework's and the raw loop's DataLoaders do not pin
        optim="adamw_torch",  # the default on torch >= 2.8 is the fused kernel, which the others do not use
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        lr_scheduler_type=o.scheduler,
        warmup_steps=math.ceil(o.warmup_ratio * t.max_steps),
        max_grad_norm=0.0,  # no clipping, like the raw loop (the recipe has max_grad_norm null)
        logging_strategy="no",
        logging_nan_inf_filter=False,  # a per-step isnan/isinf check that reads the loss on the host
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                      data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                      compute_metrics=accuracy)
    trainer.train()
    print(f"eval accuracy {trainer.evaluate()['eval_accuracy']:.4f}")
    trainer.save_model(str(Path(cfg.output_dir) / "model"))


if __name__ == "__main__":
    main()
