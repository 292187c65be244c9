"""Measurement probe that compare_loops.py loads into every training process it starts.

The parent puts this folder on PYTHONPATH, so Python imports this module at interpreter start
(before the training script), in the raw loop, the framework CLI and the Trainer script alike.
Nothing in the three training scripts is instrumented, so all three are measured the same way.

It does nothing unless BENCH_PROBE_OUT is set. Then it registers a global optimizer-step post-hook
and wraps ``torch.Tensor.backward``; per step that costs two Python calls, the same in every loop.
It records:

- the end of every optimizer step, in wall-clock seconds since BENCH_T0 (the parent's ``time.time()``
  just before the launch), so the end of step 1 is the time to first step;
- the process's CPU time (``time.process_time()``) at the end of every step: with one thread per
  process it measures the work a step costs, whatever else the machine is doing;
- the optimizer's class, kernel (foreach/fused), hyperparameters and parameter groups, and torch's
  intra-op thread count, at step 1;
- the first and the latest loss passed to ``backward``, read only at exit (no extra host sync);
- on CUDA, the allocator's peak (``torch.cuda.max_memory_allocated``).

On CUDA the hook synchronizes after step 1, step BENCH_SKIP_STEPS and step BENCH_STEPS only (the
steady-state window's ends), so those times are when the device finished the step rather than when
the host queued it. It writes one JSON object to BENCH_PROBE_OUT at interpreter exit.
"""

import os

_OUT = os.environ.pop("BENCH_PROBE_OUT", None)  # popped: processes the run starts itself are not probed


def _install(out: str) -> None:
    import atexit
    import json
    import time

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    t0 = float(os.environ["BENCH_T0"])
    # Steps after which CUDA work is drained before the time is taken: step 1 and the window's ends.
    sync_after = {1, int(os.environ["BENCH_SKIP_STEPS"]), int(os.environ["BENCH_STEPS"])}
    step_ends, step_cpu = [], []
    record = {"step_ends": step_ends, "step_cpu_seconds": step_cpu}
    losses = {}  # first_loss, last_loss: detached tensors

    def after_step(optimizer, args, kwargs):
        if len(step_ends) + 1 in sync_after and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        step_ends.append(time.time() - t0)
        step_cpu.append(time.process_time())
        if len(step_ends) == 1:
            record["optimizer"] = describe(optimizer)
            record["threads"] = torch.get_num_threads()

    def describe(optimizer) -> dict:
        """What must be equal across the loops: kernel, hyperparameters, and which parameters decay."""
        settings = ("foreach", "fused", "betas", "eps", "amsgrad", "maximize")
        groups = sorted([sum(p.numel() for p in g["params"]), g["weight_decay"], g.get("initial_lr"), g["lr"]]
                        for g in optimizer.param_groups if g["params"])
        return {"class": type(optimizer).__name__, **{k: optimizer.defaults.get(k) for k in settings},
                "groups (elements, weight decay, peak lr, step-1 lr)": groups}

    backward = torch.Tensor.backward

    def recording_backward(self, *args, **kwargs):
        loss = self.detach()
        losses.setdefault("first_loss", loss)
        losses["last_loss"] = loss
        return backward(self, *args, **kwargs)

    def write():
        record.update({name: loss.item() for name, loss in losses.items()})
        if torch.cuda.is_initialized():
            record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        with open(out, "w") as f:
            json.dump(record, f)

    register_optimizer_step_post_hook(after_step)
    torch.Tensor.backward = recording_backward
    atexit.register(write)


if _OUT:
    _install(_OUT)
