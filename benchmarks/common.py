"""What raw_loop.py, trainer_loop.py, trainer_job.py and compare_lm.py's raw and Trainer sides share with each
other and with the framework.

All take the arguments of ``recipes/run.py`` (``[--config RECIPE] KEY=VALUE...``, the default recipe
without ``--config``) and resolve them with the framework's own config loader, so every side runs with the
same settings by construction.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the framework, from this clone
from framework.config import OptimConfig, RunConfig
from framework.recipe import load_config  # noqa: E402
# The optimizer kernel the framework picks per device (fused on CUDA and the CPU): the same here, so that the
# loops differ in the loop and not in the optimizer. The probe records each loop's optimizer and
# compare_loops.py reports any difference.
from framework.optim import _kernel  # noqa: E402

DEFAULT_RECIPE = ROOT / "recipes" / "text_classification.yaml"  # recipes/run.py's default


def read_recipe(loop_only: bool = True) -> RunConfig:
    """The recipe and overrides from the command line. ``loop_only``: refuse what the loop-only scripts
    (raw_loop.py, trainer_loop.py) do not mirror."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(DEFAULT_RECIPE))
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    if not loop_only:
        return cfg
    t = cfg.train
    if cfg.precision != "no" or not t.max_steps or t.gradient_accumulation_steps != 1 or t.max_grad_norm:
        sys.exit("this loop trains in fp32 for train.max_steps steps, without accumulation or clipping: pass "
                 "train.max_steps=N train.max_grad_norm=null (and keep precision: no)")
    if cfg.optim.name != "adamw" or cfg.optim.param_groups or cfg.optim.warmup_steps is not None:
        sys.exit("this loop trains with plain AdamW and optim.warmup_ratio only")
    return cfg


def adamw(model: torch.nn.Module, cfg: OptimConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW that decays matrices (weights, embeddings) but not vectors (biases, LayerNorm scales)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             **_kernel(device_type))


def recipe_training_args(cfg: RunConfig) -> dict:
    """TrainingArguments' keyword arguments for the recipe's own settings, shared by the Trainer sides that run
    on the Trainer's defaults (trainer_job.py, compare_lm.py's Trainer side): output_dir, device, seed, steps
    (``train.max_steps``, else -1: the epochs decide), batch, accumulation, AdamW's lr, weight decay, betas and
    eps, the schedule and its warmup, clipping. Each side adds what is its own."""
    t, o = cfg.train, cfg.optim
    return dict(
        output_dir=cfg.output_dir,
        use_cpu=cfg.backend == "cpu",  # like the framework, otherwise on the GPU when there is one
        seed=cfg.seed,
        max_steps=t.max_steps or -1,
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        lr_scheduler_type=o.scheduler,
        warmup_steps=o.warmup_ratio if o.warmup_steps is None else o.warmup_steps,  # below 1: a ratio
        max_grad_norm=t.max_grad_norm or 0.0,  # 0: no clipping
    )


def accuracy(prediction) -> dict:
    """Trainer's ``compute_metrics``: the share of eval examples whose top logit is the label."""
    return {"accuracy": float(np.mean(prediction.predictions.argmax(-1) == prediction.label_ids))}


def load_data_and_model(cfg: RunConfig):
    """The framework's order and data: seed, data, tokenizer, model (its fresh head draws from the seeded
    RNG), the framework's own tokenization: the same examples in the same shapes as the framework (the eval
    rows in their own order: the framework sorts them by length, an optimisation of its own)."""
    from accelerate.utils import set_seed

    from framework import run_data
    from framework.tasks import get_task

    set_seed(cfg.seed)
    data, task = run_data.from_recipe(cfg), get_task(cfg.task)
    model, tokenizer = task.load(cfg, *data.read(task))
    data.prepare_rows(task, tokenizer, model)
    return tokenizer, model, data.train_ds, data.eval_ds
