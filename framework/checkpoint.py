"""Run outputs on disk: who owns ``output_dir``; checkpoints that are atomic, verified, retained and
resumed (only with the recipe that trained them, on its layout or another: framework/resharding.py); preemption;
saving the model.

A checkpoint is the training state (framework/backend/states.py: the trained parameters and the optimizer's state
in a form any layout loads, the schedule, grad scaler, every process's random states) plus ``trainer_state.json``
(the loop's counters, the recipe, the run's layout, and a manifest of every file with its size and SHA-256). It is
written into a hidden temporary folder and renamed to ``checkpoints/step_N`` only when complete, so a folder with
that name was fully written; the manifest catches later damage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from omegaconf import OmegaConf

from framework import adapters, backend, disk, export, profiling, report, resharding
from framework.config import RunConfig
from framework.recipe import resume_differences
from framework.errors import UserError

TRACKER_PROJECT = "framework"  # the project name the trackers log under, a folder of output_dir
# What a run writes into output_dir (the run contract). Finding any of them means another run was here.
RUN_OUTPUTS = ("config.yaml", "summary.json", "metrics.jsonl", "model", "checkpoints", report.PAGE, report.PLOTS,
               profiling.FOLDER, TRACKER_PROJECT, "wandb", "mlflow",  # the trackers' logs: tensorboard's event files in
               # output_dir/<project>, wandb's and mlflow's runs in output_dir/wandb and output_dir/mlflow
               *(export.default_out(Path("model"), kind).name for kind in export.KINDS))  # export.gguf's files
STATE_FILE = "trainer_state.json"
# A streaming run's loader state, one pair per process: the position and generator states as JSON, the
# shuffle buffer's arrays in safetensors. Nothing the framework writes needs pickle to read.
LOADER_FILE = "stream_{}.json"
LOADER_ARRAYS = "stream_{}.safetensors"


def previous_outputs(output_dir: Path) -> list:
    return [name for name in RUN_OUTPUTS if (output_dir / name).exists()]


@dataclass
class StartPoint:
    """How a run begins, decided before any slow work."""

    resume_from: Optional[Path] = None  # the checkpoint to load; None starts fresh
    clear: bool = False  # remove an earlier run's outputs from output_dir first
    continues_log: bool = False  # output_dir's own run goes on: keep its metrics.jsonl up to the checkpoint
    notes: List[str] = field(default_factory=list)  # said in the plan


def start_point(cfg: RunConfig) -> StartPoint:
    """Decide whether this run resumes (and from which checkpoint) or starts fresh, and whether an earlier
    run's outputs in ``output_dir`` may be replaced.

    A run never continues a checkpoint trained with a different recipe (any key that changes the training
    trajectory; see ``config.RESUME_FREE_KEYS``), never writes over another run's outputs unless the recipe
    says ``overwrite: true``, and never writes outside its own ``output_dir``. The same command run again
    continues its own unfinished run, also with ``overwrite: true``, which replaces only a finished run or
    one of another recipe.
    """
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir: {out} is a file; choose a folder")
    unwritable = disk.unwritable(out)
    if unwritable:
        raise UserError(f"output_dir: {unwritable}; choose another output_dir=...")
    found = previous_outputs(out)
    finished = (out / "summary.json").exists()
    source, notes = _resume_source(cfg)  # checkpoint.resume: PATH, read only
    if source is not None and source.resolve().parent == (out / "checkpoints").resolve():
        if finished:  # one of this output_dir's own checkpoints
            raise UserError(f"output_dir: the run in {out} already finished; resuming its {source.name} in place "
                            "would replace its model and summary: choose a new output_dir=... to resume from it")
        return StartPoint(source, continues_log=True, notes=notes)
    if not found:
        return StartPoint(source, notes=notes)
    replace = StartPoint(source, clear=True, notes=notes + [f"overwrite: replacing the earlier run's outputs in {out}"])
    if cfg.checkpoint.resume == "never" or finished:
        if cfg.overwrite:
            return replace
        if finished:
            raise UserError(f"output_dir: the run in {out} already finished (summary.json exists), so there is "
                            "nothing to resume; choose a new output_dir=... or pass overwrite=true")
        raise UserError(f"output_dir: {out} already holds another run's outputs ({', '.join(found)}) and "
                        "checkpoint.resume is never; choose a new output_dir=... or pass overwrite=true")
    # An unfinished run: this same command interrupted (resumed), or another recipe's (refused or replaced).
    newest, skipped = newest_complete(out / "checkpoints")
    saved = saved_recipe(newest) if newest else _recipe_file(out / "config.yaml")
    changed, harmless = recipe_differences(saved, cfg)
    if changed:
        if cfg.overwrite:
            return replace
        where = f"checkpoint {newest}" if newest else f"{out / 'config.yaml'}"
        raise UserError(f"output_dir: {out} holds an unfinished run trained with a different recipe ({where}), "
                        f"and resuming it would continue another training run. What differs:\n  - "
                        + "\n  - ".join(changed) + f"\nEither rerun the original recipe ({out / 'config.yaml'}) "
                        "to resume it, or choose a new output_dir=... for this recipe (or pass overwrite=true "
                        "to replace the unfinished run)")
    notes = skipped + (notes if newest is None else [_free_change(line) for line in harmless])
    if cfg.overwrite:
        notes.append(f"overwrite: {out} holds an unfinished run of this same recipe, so it is resumed, not "
                     "replaced; add checkpoint.resume=never to start over")
    if newest is None:  # stopped before its first checkpoint: nothing to lose
        again = f"from {source} again" if source else "over"
        return StartPoint(source, clear=True, notes=notes + [f"{out} holds an unfinished run of this recipe "
                                                             f"without a checkpoint; starting it {again}"])
    return StartPoint(newest, continues_log=True, notes=notes)


def _resume_source(cfg: RunConfig) -> Tuple[Optional[Path], List[str]]:
    """``checkpoint.resume: PATH``: that checkpoint, verified and trained with this recipe; else None."""
    if cfg.checkpoint.resume in ("auto", "never"):
        return None, []
    path = Path(cfg.checkpoint.resume)
    problem = verify(path)
    if problem:
        raise UserError(f"checkpoint.resume: {path} cannot be resumed from: {problem}")
    changed, harmless = recipe_differences(saved_recipe(path), cfg)
    if changed:
        raise UserError(f"checkpoint.resume: {path} was trained with a different recipe, and resuming it would "
                        "continue another training run. What differs:\n  - " + "\n  - ".join(changed)
                        + "\nRun the checkpoint's own recipe (its trainer_state.json holds it), or set "
                        "checkpoint.resume=never to train this recipe from the start")
    return path, [_free_change(line) for line in harmless]


def _free_change(line: str) -> str:
    return f"resuming with a changed setting that cannot change the result: {line}"


def saved_recipe(path: Path) -> Optional[Dict]:
    """The recipe a checkpoint was trained with (``config.to_dict``), as recorded in its state file."""
    return json.loads((path / STATE_FILE).read_text()).get("recipe")


def _recipe_file(path: Path) -> Optional[Dict]:
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # missing or unreadable: no recipe to compare with
        return None


def recipe_differences(saved: Optional[Dict], cfg: RunConfig) -> Tuple[List[str], List[str]]:
    if saved is None:
        return ["the earlier run's recipe is not recorded, so it cannot be compared with this one"], []
    return resume_differences(saved, cfg)


def resumed_layout(path: Path, here: resharding.Layout, cfg: RunConfig,
                   problems: Callable[[RunConfig], List[str]]) -> Tuple[RunConfig, List[str]]:
    """``resharding.resumed`` for the checkpoint at ``path``: the recipe adjusted to keep its effective batch on this
    layout, and the plan's note. A checkpoint from before layouts were recorded resumes on its device count only."""
    record = json.loads((path / STATE_FILE).read_text())
    saved = resharding.Layout.of(record.get("layout"))
    if saved is None:
        devices = record.get("devices")
        if devices is not None and devices != here.devices:
            raise UserError(f"checkpoint.resume: {path} was trained on {devices} device(s) (processes x SPMD devices) "
                            f"and this launch has {here.devices}; launch {devices} again to resume it (it was saved "
                            "before checkpoints recorded their layout), or choose a new output_dir=...")
        return cfg, []
    return resharding.resumed(saved, here, cfg, str(path), problems)


def clear_previous_outputs(output_dir: Path) -> None:
    """Remove the contract outputs of an earlier run (only called when the recipe allows overwriting)."""
    for name in previous_outputs(output_dir):
        path = output_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def truncate_metrics(output_dir: Path, state: Dict) -> None:
    """On resume, drop the log lines the interrupted run wrote after its checkpoint (``state``): they are redone.
    The checkpoint records how many there were; an older one, only its step."""
    path = output_dir / "metrics.jsonl"
    if path.exists():
        lines, count = path.read_text().splitlines(), state.get("metrics_lines")
        kept = lines[:count] if count is not None else [line for line in lines if _logged_by(line, state["step"])]
        disk.write_text(path, "".join(line + "\n" for line in kept))


def _logged_by(line: str, step: int) -> bool:
    """Whether a line of metrics.jsonl is a whole record of a step up to ``step`` (a run killed mid-line leaves a
    partial last one, redone by the resumed run)."""
    try:
        return json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
        return False


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


def save(accelerator: Accelerator, model: torch.nn.Module, optimizer, output_dir: Path, state: Dict, keep_last: int,
         protect_step: Optional[int], recipe: Dict, layout: resharding.Layout,
         loader_state: Optional[Dict] = None) -> Path:
    """Write a checkpoint atomically. Every process must call it (sharded and XLA states save collectively).
    ``recipe`` (``config.to_dict``) and ``layout`` are recorded so that a resume can be checked against them.
    ``loader_state``: this process's position in a stream (each process reads its own share).

    A failed write (no space, read-only, the folder gone) removes its temporary folder and raises
    ``disk.WriteFailed``; the checkpoints before it are untouched. Older checkpoints are removed only after the new
    one is complete (renamed into place)."""
    folder = output_dir / "checkpoints"
    name = f"step_{state['step']}"
    final, tmp = folder / name, folder / f"{disk.PARTIAL}{name}"
    what = f"checkpoint {name}"
    # The main process alone removes the shared temporary folder (another's failure reaches it at the next wait).
    with disk.writing(what, folder, _last_size(folder), partial=tmp if accelerator.is_main_process else None):
        if accelerator.is_main_process:
            disk.remove(tmp)
            folder.mkdir(exist_ok=True)  # not its parents: a vanished output_dir is not made again
            tmp.mkdir()
        accelerator.wait_for_everyone()
        backend.save_states(accelerator, model, optimizer, tmp)
        if loader_state is not None:
            save_loader_state(loader_state, tmp, accelerator.process_index)
        accelerator.wait_for_everyone()
        failed = None
        if accelerator.is_main_process:
            try:
                files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                         for p in sorted(tmp.rglob("*")) if p.is_file()}
                record = {"state": state, "layout": dataclasses.asdict(layout), "devices": layout.devices,
                          "recipe": recipe, "files": files}
                (tmp / STATE_FILE).write_text(json.dumps(record, indent=1))
                _replace(tmp, final)
            except Exception as e:
                failed = e
        # The others learn here why the main process's last writes failed (every process has written its shards).
        why = [disk.problem(folder, failed, _last_size(folder)) or "its write failed on the first process"
               if failed is not None else None]
        if accelerator.num_processes > 1:
            broadcast_object_list(why)
        if failed is not None:
            raise failed
        if why[0] is not None:
            raise disk.WriteFailed(f"cannot write {what} into {folder}: {why[0]}")
    if accelerator.is_main_process:
        _retain(folder, keep_last, protect_step)
    accelerator.wait_for_everyone()
    return final


def _last_size(folder: Path) -> Optional[int]:
    """The bytes the newest checkpoint's manifest lists (about what the next one needs), read without verifying
    it: no checksums on the way to every save. None when there is none or its manifest is unreadable."""
    steps = sorted(folder.glob("step_*"), key=_step_of)
    try:
        return sum(entry["size"] for entry in json.loads((steps[-1] / STATE_FILE).read_text())["files"].values())
    except (IndexError, OSError, ValueError, KeyError):
        return None


def _replace(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; a complete folder already there (the same step saved again) is
    moved aside first and removed only once the new one is in place."""
    old = final.with_name(f"{disk.REPLACED}{final.name}")
    if final.exists():
        disk.remove(old)
        os.replace(final, old)
    os.replace(tmp, final)  # the rename is what makes it complete
    disk.remove(old)


def _retain(folder: Path, keep_last: int, protect_step: Optional[int]) -> None:
    """Keep the newest ``keep_last`` checkpoints, plus the one at the best model's step."""
    ordered = sorted(folder.glob("step_*"), key=_step_of, reverse=True)
    for path in ordered[keep_last:]:
        if _step_of(path) != protect_step:
            shutil.rmtree(path)


def load(accelerator: Accelerator, model: torch.nn.Module, optimizer, path: Path) -> Dict:
    """Restore everything ``save`` wrote into this run's model and optimizer (resharded to their layout); returns the
    loop's state."""
    backend.load_states(accelerator, model, optimizer, path)
    return json.loads((path / STATE_FILE).read_text())["state"]


def loader_state(accelerator: Accelerator, path: Path) -> Dict:
    """This process's stream position saved by ``save``."""
    file = path / LOADER_FILE.format(accelerator.process_index)
    if not file.is_file():
        raise UserError(f"checkpoint {path} has no stream position ({file.name}): it was not saved by a "
                        "data.streaming run (or by an older version, whose stream_N.pt needed pickle); resume it "
                        "with its own recipe, or set checkpoint.resume=never")
    return load_loader_state(path, accelerator.process_index)


def save_loader_state(state: Dict, folder: Path, index: int) -> None:
    """``StreamLoader.state_dict()`` without pickle: the buffer's arrays (the examples' token ids) into
    safetensors, everything else (counters, the stream's position, the generators' states: ints, bools,
    strings) into JSON."""
    from safetensors.numpy import save_file

    arrays, buffer = {}, []
    for i, example in enumerate(state["buffer"]):
        entry = {"values": {}, "arrays": []}
        for key, value in example.items():
            if isinstance(value, np.ndarray):
                arrays[f"buffer.{i}.{key}"] = np.ascontiguousarray(value)
                entry["arrays"].append(key)
            else:
                entry["values"][key] = value
        buffer.append(entry)
    save_file(arrays, str(folder / LOADER_ARRAYS.format(index)))
    (folder / LOADER_FILE.format(index)).write_text(json.dumps({**state, "buffer": buffer}, default=_plain))


def load_loader_state(folder: Path, index: int) -> Dict:
    """What ``save_loader_state`` wrote, with the buffer's arrays as they were (dtype and shape)."""
    from safetensors.numpy import load_file

    state = json.loads((folder / LOADER_FILE.format(index)).read_text())
    arrays = load_file(str(folder / LOADER_ARRAYS.format(index)))
    state["buffer"] = [{**entry["values"], **{key: arrays[f"buffer.{i}.{key}"] for key in entry["arrays"]}}
                       for i, entry in enumerate(state["buffer"])]
    return state


def _plain(value):
    """JSON for the numpy scalars a state may hold; anything else is refused (it would need pickle)."""
    if isinstance(value, (np.integer, np.bool_, np.floating)):
        return value.item()
    raise TypeError(f"a stream's state holds a {type(value).__name__}, which JSON cannot store")


# ---------------------------------------------------------------- preemption (signals: framework/signals.py)


class Preempted(Exception):
    """Raised after the preemption checkpoint is saved; the CLI exits with status 3."""


# ---------------------------------------------------------------- model


def save_model(accelerator: Accelerator, model, tokenizer, path: Path, mesh: backend.Mesh, merge: bool = False) -> None:
    """``save_pretrained`` in safetensors with the tokenizer: loadable by ``transformers.pipeline``. An adapted
    model writes its adapter, and with ``merge`` the merged model too (``adapters.save``).

    Every process takes part in gathering the weights (sharded models gather collectively, XLA tensors
    come to the host); then only the main process touches the disk, writing into a temporary folder
    renamed over ``path`` when complete. Other processes must not call ``save_pretrained``: it lists
    and creates the folder on every rank, which races with the main process's rename.
    """
    state_dict = backend.state_dict_for_save(accelerator, model, mesh)
    if accelerator.is_main_process:
        tmp = path.with_name(f"{disk.PARTIAL}{path.name}")
        needed = sum(t.numel() * t.element_size() for t in state_dict.values()) if state_dict else None
        with disk.writing(f"{path.name}/", path.parent, needed, partial=tmp):
            disk.remove(tmp)
            unwrapped = backend.unwrap(accelerator, model, mesh)
            if adapters.is_adapted(unwrapped):
                adapters.save(unwrapped, state_dict, tokenizer, tmp, merge=merge)
            else:
                with backend.saving_gathered(unwrapped):
                    unwrapped.save_pretrained(tmp, state_dict=state_dict)
                tokenizer.save_pretrained(tmp)
            _replace(tmp, path)
    accelerator.wait_for_everyone()
