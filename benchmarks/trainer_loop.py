"""The reference for compare_loops.py: ``transformers.Trainer`` set up to do the framework's work.

Usage: ``python benchmarks/trainer_loop.py --config RECIPE [KEY=VALUE ...]``, the arguments of
``recipes/run.py``. Settings and data come from the framework, as in raw_loop.py. TrainingArguments mirror
the recipe: per-device batch, drop_last, no pinned memory (the other loops do not pin), linear schedule
with the same warmup steps, fp32, the same seed (hence the same seedable shuffle), no clipping. The
optimizer is the raw loop's AdamW (the same parameter groups, and the kernel the framework picks: fused on
the CPU and CUDA), passed in through ``optimizers=`` so that one piece of code builds it for the raw loop
and the Trainer. Logging, saving and evaluation during training are off; after training it does the
framework's final work: one eval pass and save_pretrained. (benchmarks/trainer_job.py is the other use of
the Trainer: on its own defaults, as a user runs it.)
"""

import math
import sys
from pathlib import Path

from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

from common import accuracy, adamw, load_data_and_model, read_recipe


def main() -> None:
    cfg = read_recipe()
    t, o = cfg.train, cfg.optim
    training_args = TrainingArguments(
        output_dir=cfg.output_dir,
        use_cpu=cfg.backend == "cpu",
        seed=cfg.seed,
        per_device_train_batch_size=t.batch_size,
        per_device_eval_batch_size=t.eval_batch_size or 2 * t.batch_size,
        max_steps=t.max_steps,
        dataloader_drop_last=True,
        dataloader_pin_memory=False,
        lr_scheduler_type=o.scheduler,
        warmup_steps=math.ceil(o.warmup_ratio * t.max_steps),
        max_grad_norm=0.0,
        logging_strategy="no",
        logging_nan_inf_filter=False,  # a per-step isnan/isinf test of the loss, read on the host
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
    )
    tokenizer, model, train_ds, eval_ds = load_data_and_model(cfg)
    if len(train_ds) // t.batch_size < t.max_steps:
        sys.exit(f"train.max_steps={t.max_steps} is more than one epoch ({len(train_ds) // t.batch_size} steps)")

    trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                      data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                      compute_metrics=accuracy, optimizers=(adamw(model, o, training_args.device.type), None))
    trainer.train()
    print(f"eval {trainer.evaluate()}")
    trainer.save_model(str(Path(cfg.output_dir) / "model"))


if __name__ == "__main__":
    main()
