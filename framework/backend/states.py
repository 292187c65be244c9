"""A checkpoint's training state in a form any topology loads: the trained parameters and the optimizer's state as a
torch.distributed.checkpoint (DCP) folder (``states/``), every tensor named by its parameter's fully qualified name
(torch's ``get_state_dict``: the same names whatever wraps or shards the model), written by every process in
parallel, each its own shards (FSDP2, HSDP, tensor parallelism, 2D: DTensors; DDP and one process: the replicated
tensors once), or, with ``distributed.fsdp.state_dict: full`` (the FSDP plugin's full state dict), gathered and
written by the first process. Loading reads whatever slices the loading layout needs (DCP reshards on load), so a checkpoint of
2 FSDP2 processes resumes on 1 process, under DDP, under tensor parallelism, and the other way round.

Only trained parameters are written (``ignore_frozen_params``: an adapter's base, frozen, comes again from the
pretrained model on a resume), with their optimizer state (``flatten_optimizer_state_dict``: one entry per
parameter's state, resharded like the parameter). Beside them, what accelerate saves of a run apart from the
model and optimizer (the schedule, the sampler, the grad scaler, each process's random states:
``accelerate.checkpointing.save_accelerator_state`` with no model or optimizer), which holds no per-topology layout
but the random states (a process of another topology finds none of its own and keeps its seeded ones).

DeepSpeed and XLA keep accelerate's own checkpoint (``accelerator.save_state``): DeepSpeed's engine holds its
flattened partitions itself, and XLA's tensors save through torch's format; neither resumes on another topology
(``portable``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from framework.backend.topology import on_xla

if TYPE_CHECKING:
    from accelerate import Accelerator

STATES = "states"  # the DCP folder in a checkpoint
STATE = "state."  # the optimizer state's entries in get_state_dict's flattened form (beside "param_groups.")
OPTIONS = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True)
# Loading: the frozen parameters are not in the checkpoint (dcp.load has already refused a trained one missing).
LOADING = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True, strict=False)
GATHERED = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True, full_state_dict=True,
                            cpu_offload=True)


def portable(accelerator: Accelerator) -> bool:
    """Whether this run's checkpoints hold the DCP states (every strategy but DeepSpeed and XLA)."""
    return accelerator.distributed_type != "DEEPSPEED" and not on_xla(accelerator)


def save(accelerator: Accelerator, model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Write the run's training state into ``folder``. Every process must call it (the shards are written
    collectively)."""
    if not portable(accelerator):
        # XLA tensors cannot be saved as safetensors (accelerate loads them through storage pointers they lack).
        accelerator.save_state(str(folder), safe_serialization=not on_xla(accelerator))
        return
    # accelerate's, imported here: no module of the backend imports accelerate before select_backend ran.
    from accelerate.checkpointing import save_accelerator_state

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    full = plugin is not None and str(plugin.state_dict_type).endswith("FULL_STATE_DICT")
    fresh = not optimizer.optimizer.state  # no update yet (only skipped steps): get_state_dict makes Adam's state by
    # a zero-lr step, whose step count would change the first real update: undone, and not saved
    model_state, optimizer_state = get_state_dict(model, optimizer.optimizer, options=GATHERED if full else OPTIONS)
    if fresh:
        optimizer.optimizer.state.clear()
        optimizer_state = {k: v for k, v in optimizer_state.items() if not k.startswith(STATE)}
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / STATES))
    save_accelerator_state(str(folder), [], [], accelerator._schedulers, accelerator._dataloaders,
                           accelerator.process_index, accelerator.step, accelerator.scaler)


def load(accelerator: Accelerator, model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Restore what ``save`` wrote into this run's model and optimizer, resharded to their layout here."""
    if not (folder / STATES).is_dir():
        accelerator.load_state(str(folder))
        return
    from accelerate.checkpointing import load_accelerator_state  # as in save

    saved = dcp.FileSystemReader(str(folder / STATES)).read_metadata().state_dict_metadata
    updated = any(key.startswith(f"optimizer.{STATE}") for key in saved)
    inner = optimizer.optimizer
    model_state, optimizer_state = get_state_dict(model, inner, options=OPTIONS)
    # Saved before any update (see save): the group settings are read, the state get_state_dict made is dropped after.
    wanted = optimizer_state if updated else {k: v for k, v in optimizer_state.items() if not k.startswith(STATE)}
    dcp.load({"model": model_state, "optimizer": wanted}, checkpoint_id=str(folder / STATES))
    optimizer_state.update(wanted)
    set_state_dict(model, inner, model_state_dict=model_state, optim_state_dict=optimizer_state, options=LOADING)
    if not updated:
        inner.state.clear()
    load_accelerator_state(str(folder), [], [], accelerator._schedulers, accelerator._dataloaders,
                           accelerator.process_index, accelerator.scaler)
    # accelerate's micro-batch count, whose multiples of the accumulation end a window: a checkpoint is saved at a
    # window's end, so the next window starts at 0, whatever accumulation this layout takes (the saved count is a
    # multiple of the saved layout's, which another accumulation would cut in the middle of a window).
    accelerator.step = 0


def load_model(model: torch.nn.Module, folder: Path) -> bool:
    """The trained parameters a checkpoint's states hold, put into ``model``, a whole model on this process (no
    process group needed; the shards of any layout are read as one): the chat command's reading of a checkpoint.
    False where the checkpoint holds no DCP states (DeepSpeed's and XLA's own checkpoints)."""
    if not (folder / STATES).is_dir():
        return False
    state = get_model_state_dict(model, options=OPTIONS)
    dcp.load({"model": state}, checkpoint_id=str(folder / STATES))
    set_model_state_dict(model, state, options=LOADING)
    return True
