"""The probe benchmarks/profile_steps.py loads into both training processes (this folder on PYTHONPATH).

It does nothing unless PROF_OUT is set. Then, hooked from outside the training script (a global module
forward pre-hook, ``torch.Tensor.backward`` and the optimizer step post-hook, the same in both loops), per
optimizer step: ``between``, from the end of the previous step to the first forward of a module in training
mode (loading, collation, logging, the schedule, checkpoint checks); ``forward``, to the first ``backward``;
``backward_step``, to the end of the optimizer step (backward, clipping, the step). And ``torch.profiler``
over steps PROF_START to PROF_END: per op, its calls and self CPU time. One JSON object to PROF_OUT at exit.
"""
import os

_OUT = os.environ.pop("PROF_OUT", None)


def _install(out):
    import atexit, json, time
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    start, end = int(os.environ.get("PROF_START", 21)), int(os.environ.get("PROF_END", 30))
    rec = {"between": [], "forward": [], "backward_step": []}
    st = {"last_end": None, "fwd": None, "bwd": None, "steps": 0, "prof": None, "in_step": False}

    def pre_hook(module, args):
        if not st["in_step"] and module.training:
            st["in_step"] = True
            st["fwd"] = time.perf_counter()
        return None
    torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    backward = torch.Tensor.backward

    def rec_backward(self, *a, **k):
        if st["bwd"] is None:
            st["bwd"] = time.perf_counter()
        return backward(self, *a, **k)
    torch.Tensor.backward = rec_backward

    def after_step(opt, args, kwargs):
        now = time.perf_counter()
        st["steps"] += 1
        n = st["steps"]
        if st["last_end"] is not None and st["fwd"] is not None:
            rec["between"].append(st["fwd"] - st["last_end"])
        if st["fwd"] is not None and st["bwd"] is not None:
            rec["forward"].append(st["bwd"] - st["fwd"])
            rec["backward_step"].append(now - st["bwd"])
        if n == start - 1:
            st["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
            st["prof"].__enter__()
        if n == end and st["prof"] is not None:
            p = st["prof"]; p.__exit__(None, None, None)
            rows = [{"name": e.key, "count": e.count, "self_us": e.self_cpu_time_total, "total_us": e.cpu_time_total}
                    for e in p.key_averages()]
            rec["ops"] = sorted(rows, key=lambda r: -r["self_us"])
            st["prof"] = None
        st["in_step"], st["fwd"], st["bwd"] = False, None, None
        st["last_end"] = time.perf_counter()
    register_optimizer_step_post_hook(after_step)
    rec["threads"] = torch.get_num_threads()

    def write():
        rec["threads_end"] = torch.get_num_threads()
        with open(out, "w") as f:
            json.dump(rec, f)
    atexit.register(write)


if _OUT:
    _install(_OUT)
