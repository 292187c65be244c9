"""Run outputs on disk: who owns ``output_dir``, and saving the final model."""

from __future__ import annotations

import shutil
from pathlib import Path

from accelerate import Accelerator

from framework import device
from framework.config import RunConfig
from framework.errors import UserError

# What a run writes into output_dir (the run contract). Finding any of them means another run was here.
RUN_OUTPUTS = ("config.yaml", "summary.json", "metrics.jsonl", "model", "checkpoints")


def previous_outputs(output_dir: Path) -> list:
    return [name for name in RUN_OUTPUTS if (output_dir / name).exists()]


def check_output_dir(cfg: RunConfig) -> None:
    """Refuse to write over another run's outputs unless the recipe says ``overwrite: true``."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir: {out} is a file; choose a folder")
    found = previous_outputs(out)
    if found and not cfg.overwrite:
        raise UserError(f"output_dir: {out} already holds another run's outputs ({', '.join(found)}); "
                        f"choose a new output_dir=... or pass overwrite=true to replace them")


def clear_previous_outputs(output_dir: Path) -> None:
    """Remove the contract outputs of an earlier run (only called when the recipe allows overwriting)."""
    for name in previous_outputs(output_dir):
        path = output_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def save_model(accelerator: Accelerator, model, tokenizer, path: Path) -> None:
    """``save_pretrained`` in safetensors with the tokenizer: loadable by ``transformers.pipeline``.

    Every process takes part (sharded or XLA models gather their weights collectively); only the main
    process writes.
    """
    state_dict = device.state_dict_for_save(accelerator, model)
    accelerator.unwrap_model(model).save_pretrained(
        path, is_main_process=accelerator.is_main_process, state_dict=state_dict, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(path)
