"""The Trainer as a user gets it: the other side of compare_loops.py's end-to-end case (``default_job``).

Usage: ``python benchmarks/trainer_job.py [--no-checkpoints] [--config RECIPE] [KEY=VALUE ...]``, the arguments
of ``recipes/run.py`` (its default recipe without ``--config``); ``--no-checkpoints``: no checkpoint saves
(``save_strategy="no"``), the model is still saved at the end. It is run the way Trainer scripts are run,
with plain ``python``: torch then uses every core, its own default.

The job is the recipe's whole job, written as a user writes it with ``transformers.Trainer``: train for the
recipe's epochs, evaluate accuracy once at the end, save the model. The settings are the recipe's, read
with the framework's config loader, so an override (``data.max_train_samples=256``) reaches both sides of
the comparison alike. The examples are the framework's: the same seeded train/eval split, tokenized the same
way (truncation to ``data.max_length``, no padding), by ``common.load_data_and_model``, which also seeds
before it builds the model, as transformers' examples do (the fresh classification head is then the
framework's).

Everything else is the Trainer's own default: its optimizer (``adamw_torch_fused``, decay on all but biases
and LayerNorm), its length-grouped sampler (``train_sampling_strategy="group_by_length"``, when the recipe
groups), its collator (DataCollatorWithPadding from ``processing_class``: dynamic padding), its data loader
(no workers, pinned memory, the last partial batch kept), its logging (every 500 steps) and its saving
(a checkpoint every 500 steps and at the end of training). The hyperparameters are the recipe's: epochs,
batch, learning rate, linear warmup ratio, weight decay, Adam's betas and eps, clipping (1.0 in the recipe,
as in the Trainer), seed. One setting goes beyond what a user must write: the eval batch is the framework's
(twice the train batch) instead of the Trainer's 8, so that both sides' eval passes do the same work.

Writes ``summary.json`` in ``output_dir`` with the framework's keys where they apply: ``train.steps``,
``train.wall_seconds`` (the Trainer's ``train_runtime``), ``eval.accuracy`` and ``eval.wall_seconds``.
"""

import json
import sys
from pathlib import Path

from transformers import Trainer, TrainingArguments

from common import accuracy, load_data_and_model, read_recipe, recipe_training_args


NO_CHECKPOINTS = "--no-checkpoints"


def main() -> None:
    saves = NO_CHECKPOINTS not in sys.argv
    if not saves:  # the rest are recipes/run.py's arguments
        sys.argv.remove(NO_CHECKPOINTS)
    cfg = read_recipe(loop_only=False)
    t, o = cfg.train, cfg.optim
    if cfg.precision != "no" or o.name != "adamw" or o.param_groups:
        sys.exit("trainer_job.py mirrors fp32 training with plain AdamW (precision: no, optim.name: adamw, "
                 "no optim.param_groups)")
    tokenizer, model, train_ds, eval_ds = load_data_and_model(cfg)
    args = TrainingArguments(
        **recipe_training_args(cfg),
        num_train_epochs=t.epochs,
        per_device_eval_batch_size=t.eval_batch_size or 2 * t.batch_size,
        train_sampling_strategy="group_by_length" if cfg.data.group_by_length else "random",
        **({} if saves else {"save_strategy": "no"}),
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                      processing_class=tokenizer, compute_metrics=accuracy)
    trained = trainer.train()
    evaluation = trainer.evaluate()
    print(f"eval {evaluation}")
    trainer.save_model(str(Path(cfg.output_dir) / "model"))
    summary = {"train": {"steps": trained.global_step, "wall_seconds": trained.metrics["train_runtime"]},
               "eval": {"accuracy": evaluation["eval_accuracy"], "wall_seconds": evaluation["eval_runtime"]}}
    (Path(cfg.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
