"""What raw_loop.py, trainer_loop.py and trainer_job.py share with each other and with the framework.

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
from framework.config import OptimConfig, RunConfig, load_config  # noqa: E402
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


def accuracy(prediction) -> dict:
    """Trainer's ``compute_metrics``: the share of eval examples whose top logit is the label."""
    return {"accuracy": float(np.mean(prediction.predictions.argmax(-1) == prediction.label_ids))}


def load_data_and_model(cfg: RunConfig):
    """The framework's order: seed, data, tokenizer, model (its fresh head draws from the seeded RNG),
    then the framework's own tokenization: the same examples in the same shapes as the framework."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from framework.data import load_splits, tokenize

    set_seed(cfg.seed)
    splits = load_splits(cfg.data, cfg.seed)
    labels = splits.label_names
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        cfg.model.name_or_path, num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)})
    return tokenizer, model, tokenize(splits.train, tokenizer, cfg.data), tokenize(splits.eval, tokenizer, cfg.data)
