"""What raw_loop.py and trainer_loop.py share with each other and with the framework.

Both take the arguments of ``recipes/run.py`` (``--config RECIPE KEY=VALUE...``) and resolve them with the
framework's own config loader, so the three loops run with the same settings by construction.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the framework, from this clone
from framework.config import OptimConfig, RunConfig, load_config  # noqa: E402

# The AdamW kernel the framework picks per device (framework/optim.py): the same here, so that the loops
# differ in the loop and not in the optimizer. The probe records each loop's optimizer and
# compare_loops.py reports any difference.
ADAMW_KERNEL = {"cuda": {"fused": True}, "cpu": {"foreach": True}}


def read_recipe() -> RunConfig:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
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
                             **ADAMW_KERNEL.get(device_type, {}))


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
