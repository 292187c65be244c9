"""Run outputs on disk: who owns ``output_dir``; checkpoints that are atomic, verified, retained and
resumed; preemption; saving the model.

A checkpoint is ``accelerator.save_state`` (model, optimizer, scheduler, grad scaler, every process's RNG
states) plus ``trainer_state.json`` (the loop's counters and a manifest of every file with its size and
SHA-256). It is written into a hidden temporary folder and renamed to ``checkpoints/step_N`` only when
complete, so a folder with that name was fully written; the manifest catches later damage.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from accelerate import Accelerator

from framework import device
from framework.config import RunConfig
from framework.errors import UserError

# What a run writes into output_dir (the run contract). Finding any of them means another run was here.
RUN_OUTPUTS = ("config.yaml", "summary.json", "metrics.jsonl", "model", "checkpoints")
STATE_FILE = "trainer_state.json"
EXIT_PREEMPTED = 3  # the run stopped on SIGTERM/SIGINT after saving a checkpoint; rerun it to resume


def previous_outputs(output_dir: Path) -> list:
    return [name for name in RUN_OUTPUTS if (output_dir / name).exists()]


def start_point(cfg: RunConfig) -> Tuple[Optional[Path], List[str]]:
    """Decide, before any slow work, whether this run resumes (and from which checkpoint) or starts fresh.

    Returns (checkpoint or None, warnings about checkpoints skipped as damaged). Refuses to write over
    another run's outputs unless the recipe says ``overwrite: true``.
    """
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir: {out} is a file; choose a folder")
    resume = cfg.checkpoint.resume
    if cfg.overwrite:
        return None, []
    if resume not in ("auto", "never"):
        path = Path(resume)
        problem = verify(path)
        if problem:
            raise UserError(f"checkpoint.resume: {path} cannot be resumed from: {problem}")
        _refuse_finished(out)
        return path, []
    found = previous_outputs(out)
    if not found:
        return None, []
    if resume == "auto" and (out / "checkpoints").is_dir():
        _refuse_finished(out)
        newest, warnings = newest_complete(out / "checkpoints")
        if newest is not None:
            return newest, warnings
    raise UserError(f"output_dir: {out} already holds another run's outputs ({', '.join(found)}); "
                    f"choose a new output_dir=... or pass overwrite=true to replace them")


def _refuse_finished(out: Path) -> None:
    if (out / "summary.json").exists():
        raise UserError(f"output_dir: the run in {out} already finished (summary.json exists), so there is "
                        "nothing to resume; choose a new output_dir=... or pass overwrite=true")


def clear_previous_outputs(output_dir: Path) -> None:
    """Remove the contract outputs of an earlier run (only called when the recipe allows overwriting)."""
    for name in previous_outputs(output_dir):
        path = output_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def truncate_metrics(output_dir: Path, step: int) -> None:
    """On resume, drop the log lines the interrupted run wrote after its checkpoint: they are redone."""
    path = output_dir / "metrics.jsonl"
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


# ---------------------------------------------------------------- checkpoints


def _step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path) -> Optional[str]:
    """None when ``path`` is a complete checkpoint, else what is wrong with it."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        return f"{STATE_FILE} is missing"
    try:
        manifest = json.loads(state_file.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{STATE_FILE} is unreadable ({e})"
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["size"] or _sha256(file) != expected["sha256"]:
            return f"{name} is damaged (size or checksum differs)"
    return None


def newest_complete(folder: Path) -> Tuple[Optional[Path], List[str]]:
    """The newest checkpoint that verifies, and a warning for each newer one that does not."""
    warnings = []
    for path in sorted(folder.glob("step_*"), key=_step_of, reverse=True):
        problem = verify(path)
        if problem is None:
            return path, warnings
        warnings.append(f"skipping checkpoint {path}: {problem}")
    return None, warnings


def save(accelerator: Accelerator, output_dir: Path, state: Dict, keep_last: int, protect_step: Optional[int]) -> Path:
    """Write a checkpoint atomically. Every process must call it (sharded and XLA states save collectively)."""
    folder = output_dir / "checkpoints"
    final = folder / f"step_{state['step']}"
    tmp = folder / f".tmp_step_{state['step']}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / STATE_FILE).write_text(json.dumps({"state": state, "files": files}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the rename is what makes it a checkpoint
        _retain(folder, keep_last, protect_step)
    accelerator.wait_for_everyone()
    return final


def _retain(folder: Path, keep_last: int, protect_step: Optional[int]) -> None:
    """Keep the newest ``keep_last`` checkpoints, plus the one at the best model's step."""
    ordered = sorted(folder.glob("step_*"), key=_step_of, reverse=True)
    for path in ordered[keep_last:]:
        if _step_of(path) != protect_step:
            shutil.rmtree(path)


def load(accelerator: Accelerator, path: Path) -> Dict:
    """Restore everything ``save`` wrote; returns the loop's state."""
    accelerator.load_state(str(path))
    return json.loads((path / STATE_FILE).read_text())["state"]


# ---------------------------------------------------------------- preemption


class Preemption:
    """SIGTERM/SIGINT ask the loop to stop after the current optimizer step and save a checkpoint.

    All processes must stop at the same step (saving is collective), so with several processes the request
    is combined across them each time the loop asks (at log steps).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: Optional[int] = None
        self._previous = {}

    def __enter__(self) -> "Preemption":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def requested(self, accelerator: Accelerator) -> bool:
        if accelerator.num_processes == 1:
            return self.signal is not None
        flag = torch.tensor([1.0 if self.signal else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item())


class Preempted(Exception):
    """Raised after the preemption checkpoint is saved; the CLI exits with EXIT_PREEMPTED."""


# ---------------------------------------------------------------- model


def save_model(accelerator: Accelerator, model, tokenizer, path: Path) -> None:
    """``save_pretrained`` in safetensors with the tokenizer: loadable by ``transformers.pipeline``.

    Every process takes part in gathering the weights (sharded models gather collectively, XLA tensors
    come to the host); then only the main process touches the disk, writing into a temporary folder
    renamed over ``path`` when complete. Other processes must not call ``save_pretrained``: it lists
    and creates the folder on every rank, which races with the main process's rename.
    """
    state_dict = device.state_dict_for_save(accelerator, model)
    if accelerator.is_main_process:
        tmp = path.with_name(f".tmp_{path.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()
