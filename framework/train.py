"""setup -> fit -> evaluate: one explicit loop, read top to bottom, no callback engine."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from accelerate.utils import set_seed

from framework import (adapters, backend, card, checkpoint, disk, export, flops, harness, health, hub, memory, noise,
                       report, resharding, run_data)
from framework.config import RunConfig, to_dict, to_yaml
from framework.disk import write_json, write_text
from framework.errors import UserError
from framework.loss_window import LossWindow
from framework.optim import build_optimizer, build_scheduler
from framework.profiling import StepProfiler
from framework.report import Clock, LivePage, Reporter, hyperparameters, tracker_options, write_report
from framework.signals import Signals
from framework.step import Step, StepContext, Update
from framework.tasks import TaskRun, get_task


@dataclass
class TrainState:
    """Counters shared by the loop and checkpointing (saved as JSON in every checkpoint)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    epoch_step: int = 0  # optimizer steps done in the current epoch: where a resumed epoch continues
    last_loss: Optional[float] = None  # mean training loss of the latest log window
    tokens: int = 0  # non-padding tokens trained on, all processes, up to the latest checkpoint
    evals: list = field(default_factory=list)
    best_step: Optional[int] = None  # the step whose model is in model/ when eval.metric is set
    best_value: Optional[float] = None
    evals_without_improvement: int = 0
    harness: Optional[dict] = None  # the latest lm-evaluation-harness result, with its step (eval.harness)
    stopped_early: bool = False
    skipped_steps: int = 0  # train.on_nonfinite: skip: steps whose update was skipped, in all and in a row
    skipped_in_a_row: int = 0
    metrics_lines: Optional[int] = None  # lines of metrics.jsonl at the checkpoint (the resume keeps those)
    window: Optional[dict] = None  # the unlogged part of the loss window, at the checkpoint


@dataclass
class Run:
    """What setup built and the loop trains with."""

    cfg: RunConfig
    accelerator: Accelerator
    mesh: backend.Mesh  # the devices one process drives under SPMD (one otherwise)
    model: torch.nn.Module  # as accelerate prepared it
    tokenizer: object
    task: TaskRun  # the task bound to this run
    data: run_data.RunData  # the rows or the stream, the eval set, the loaders
    train_step: Step  # the task's step over each step's micro-batches
    update: Update  # the optimizer, its schedule, clipping, skipped updates
    total_steps: int
    start: checkpoint.StartPoint
    plan: Dict[str, object]
    memory_plan: Dict[str, object]
    model_flops: flops.ModelFlops
    peak_flops: Optional[float]  # all devices together, FLOP/s; None where the device's peak is unknown
    replicas: int  # the data-parallel copies of the model (devices over the tensor-parallel size)
    compile_watch: backend.CompileWatch
    clock: Clock
    harness: Optional[harness.Harness]  # eval.harness's tasks, found and checked

    @cached_property
    def context(self) -> StepContext:
        """What each step is given."""
        return StepContext(self.accelerator, self.model, self.mesh, self.task, self.update, self.data.train_ds)


def setup(cfg: RunConfig) -> Run:
    """Check the inputs, then build the accelerator, data, model, optimizer and schedule."""
    notes = []
    if cfg.precision == "auto":  # decided first: the recipe a checkpoint records, and a resume compares, is concrete
        precision, why = backend.auto_precision(cfg)
        cfg = dataclasses.replace(cfg, precision=precision)
        notes.append(f"precision: auto is {precision} here ({why})")
    # Cheap checks first, so a mistake is reported before any slow work; every problem found at once.
    problems: List[str] = []
    start = _checked(problems, checkpoint.start_point, cfg)
    data = _checked(problems, run_data.from_recipe, cfg)
    for key in ("name_or_path", "tokenizer"):
        if getattr(cfg.model, key):
            _checked(problems, hub.check_model_path, getattr(cfg.model, key), f"model.{key}")
    _checked(problems, report.check_trackers, cfg.report_to)
    if problems:
        raise UserError(problems[0] if len(problems) == 1 else
                        f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))

    declared = get_task(cfg.task)
    train_step = declared.step(cfg)
    accelerator, mesh = backend.build_accelerator(cfg, train_step.micro_batches_per_update)
    lm_harness = None
    if cfg.eval.harness is not None:
        if cfg.eval.harness.every_steps and backend.needs_static_shapes(accelerator):
            raise UserError("eval.harness.every_steps: on XLA the harness runs once, at the end, on a host copy of "
                            "the model (each request's new shape would compile a new graph); remove it")
        lm_harness = harness.Harness(cfg.eval.harness, cfg.seed)
    replicas = backend.data_parallel(accelerator)[1] * mesh.devices
    if start.resume_from is not None:  # on its layout, or on another with the same effective batch
        here = layout(cfg, accelerator, mesh, replicas)
        cfg, notes_resumed = checkpoint.resumed_layout(start.resume_from, here, cfg,
                                                       lambda c: declared.check(c, backend.planned_strategy(c)))
        notes += notes_resumed
        data.cfg = cfg  # its loaders take the batch the layout keeps
        train_step = declared.step(cfg)
        accelerator.gradient_accumulation_steps = train_step.micro_batches_per_update
    set_seed(cfg.seed)  # before the model: a new model or head draws from the global RNG
    t = cfg.train
    per_step = t.batch_size * t.gradient_accumulation_steps * replicas
    # The main process reads and tokenizes first and fills the datasets cache; the others then read it.
    with accelerator.main_process_first(), backend.loading_whole_models(accelerator):
        model, tokenizer = declared.load(cfg, *data.read(declared))
        data.prepare_rows(declared, tokenizer, model, mesh)
    backend.whole_on_every_process(accelerator, model)
    model = adapters.apply(model, cfg, accelerator.device.type, declared.peft_task_type)
    model = backend.tensor_parallel_model(accelerator, model)
    # Bound to the model as loaded: DPO's frozen reference is copied before training changes the model.
    task = declared.bind(cfg, model, accelerator)

    data.build_loaders(accelerator, declared, tokenizer, model, mesh, replicas)
    if backend.model_checkpointing(cfg):
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise UserError(f"train.gradient_checkpointing: {type(model).__name__} does not support it; "
                            "set train.gradient_checkpointing=false")
        # Non-reentrant: works with frozen inputs and keeps the RNG state, so results match without it.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model = backend.place_model(accelerator, model)
    seq_length = declared.sequence_length(cfg, model)
    # Before anything shards the model: the plan divides what the strategy shards by its shard count.
    shards = mesh.parameter_shards if mesh.shard_parameters else backend.parameter_shards(accelerator)
    memory_plan = memory.plan(model, cfg, backend.memory_layout(cfg, shards), workload=task.workload(model),
                              device_bytes=backend.total_memory_bytes(accelerator))
    task.gathers_weights = memory_plan["gathers_weights"]
    model_flops = flops.model_flops(model)
    peak, peak_source = backend.peak_flops(accelerator)
    model = mesh.shard_model(model)  # xla_fsdp; the optimizer is built over the sharded parameters
    optimizer = build_optimizer(model, cfg.optim, accelerator.device.type,
                                dtensors=backend.has_dtensor_parameters(accelerator))
    model, optimizer, *loaders = accelerator.prepare(model, optimizer, *data.loaders())
    backend.check_optimizer_parameters(accelerator, model, optimizer)
    data.use_prepared(loaders, mesh)
    if accelerator.gradient_accumulation_steps != train_step.micro_batches_per_update:
        # accelerate takes a DeepSpeed config file's own value over the run's (with a warning only).
        raise UserError(f"train.gradient_accumulation_steps: the launch's DeepSpeed config accumulates "
                        f"{accelerator.gradient_accumulation_steps} micro-batches per update, this run "
                        f"{train_step.micro_batches_per_update}; set gradient_accumulation_steps to auto in the "
                        "DeepSpeed config file, or remove it there")
    steps_per_epoch = data.steps_per_epoch  # None for a stream: train.max_steps sizes the run
    total_steps = t.max_steps or max(1, math.ceil(t.epochs * steps_per_epoch))
    # One schedule step per weight update (a step of online RL updates iterations x generation_steps times).
    # prepare_scheduler, not prepare: under DeepSpeed, prepare() of a scheduler alone returns it unregistered, so
    # checkpoints lacked its state (a resume restarted the warmup).
    scheduler = accelerator.prepare_scheduler(build_scheduler(optimizer, cfg.optim, total_steps * train_step.updates))
    mesh.attach(accelerator, optimizer)
    k = cfg.distributed.local_sgd_steps  # local SGD: parameters averaged every k updates, no gradient all-reduce
    update = Update(accelerator, model, optimizer, scheduler, t.max_grad_norm,
                    health.SkippedSteps(t.max_skipped_steps) if t.on_nonfinite == "skip" else None,
                    LocalSGD(accelerator, model, k) if k else None)

    plan = {
        **backend.describe(cfg, accelerator, mesh),
        "per_device_batch": t.batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "effective_batch": per_step,
        **data.plan(),
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "epochs": round(total_steps / steps_per_epoch, 3) if steps_per_epoch else None,
        "resume_from": str(start.resume_from) if start.resume_from else None,
        "model_flops_per_token": f"{model_flops.at(seq_length):.4g} at {seq_length} tokens "
                                 f"({model_flops.matmul_parameters / 1e6:.2f}M non-embedding parameters; PaLM's "
                                 "6N + 12LHQT, framework/flops.py)",
        "peak_flops": f"{peak / 1e12:.4g} TFLOP/s per device ({peak_source})" if peak else None,
        "notes": (notes + backend.notes(cfg, accelerator) + start.notes + data.notes(declared)
                  + ([] if peak else [f"mfu: {peak_source}"])),
    }
    # Expected XLA graphs: a train step per bucket, the first step (optimizer state creation), evaluation, the
    # task's own (online RL's generation) and the sharding's.
    expected_graphs = len(data.buckets or []) + 4 + task.compiled_graphs + mesh.extra_graphs
    return Run(cfg=cfg, accelerator=accelerator, mesh=mesh, model=model, tokenizer=tokenizer, task=task, data=data,
               train_step=train_step, update=update, total_steps=total_steps, start=start, plan=plan,
               memory_plan=memory_plan, model_flops=model_flops, peak_flops=peak * replicas if peak else None,
               replicas=replicas,
               compile_watch=backend.CompileWatch(accelerator, expected_graphs), clock=Clock(), harness=lm_harness)


def layout(cfg: RunConfig, accelerator: Accelerator, mesh: backend.Mesh, replicas: int) -> resharding.Layout:
    """How this run splits its work (what a checkpoint records, and a resume compares)."""
    return resharding.Layout(processes=accelerator.num_processes, devices=accelerator.num_processes * mesh.devices,
                             replicas=replicas, strategy=backend.strategy_name(accelerator, mesh),
                             batch_size=cfg.train.batch_size, accumulation=cfg.train.gradient_accumulation_steps,
                             portable=backend.portable_states(accelerator), streaming=cfg.data.streaming)


def _checked(problems: List[str], check, *args):
    """``check(*args)``'s result; its UserError's message goes into ``problems`` instead of stopping the run."""
    try:
        return check(*args)
    except UserError as e:
        problems.append(str(e))
        return None


class Saves:
    """When the loop saves and stops: checkpoints every N steps, every epoch, every M minutes (the clock
    restarts at each save), and a stop requested by SIGTERM/SIGINT (saved, then Preempted)."""

    def __init__(self, run: Run, signals: Signals, reporter: Reporter):
        self.run, self.signals, self.reporter = run, signals, reporter
        self.last, self.saved_step = time.monotonic(), None
        minutes = run.cfg.checkpoint.every_minutes
        self.seconds = minutes * 60 if minutes else None
        # One process reads its own flags every step; several must agree (an all-reduce and a host read),
        # so they ask only when they log anyway.
        self.check_every = backend.preemption_check_interval(run.accelerator, run.cfg.train.log_every)

    def save(self, state: TrainState, window: LossWindow) -> None:
        with self.run.compile_watch.host_work(), self.run.clock.phase("checkpoint"):
            state.metrics_lines = self.reporter.lines
            _save_checkpoint(self.run, state, window)
        self.last, self.saved_step = time.monotonic(), state.step

    def after_step(self, state: TrainState, window: LossWindow) -> None:
        every = self.run.cfg.checkpoint.every_steps
        if every and state.step % every == 0:
            self.save(state, window)
        if state.step % self.check_every == 0 or state.step >= self.run.total_steps:
            self.stop_or_save(state, window)

    def stop_or_save(self, state: TrainState, window: LossWindow) -> None:
        due = self.seconds is not None and time.monotonic() - self.last >= self.seconds
        # One process decides from its own flags, every step and without touching the device; several
        # agree with an all-reduce, a host read at log steps.
        several = self.run.accelerator.num_processes > 1
        with self.run.compile_watch.host_work() if several else nullcontext():
            stop, due = backend.any_process(self.run.accelerator, self.signals.signal is not None, due)
        if (stop or due) and self.saved_step != state.step:  # not saved at this step by every_steps already
            self.save(state, window)
        if stop:
            raise checkpoint.Preempted(f"stopped by {self.signals.name} after step {state.step}; checkpoint saved, "
                                       "run the same command again to resume")


def fit(run: Run, reporter: Reporter, state: TrainState, signals: Signals) -> float:
    """Train until ``total_steps`` optimizer steps are done (or early stopping), evaluating after every
    whole epoch or every ``eval.every_steps``; returns the model FLOPs trained. Raises Preempted after saving on
    SIGTERM/SIGINT."""
    cfg = run.cfg
    window = LossWindow(run.accelerator, run.model_flops)
    window.restore(state.window, cfg.train.gradient_accumulation_steps)
    profiler = StepProfiler(run.accelerator, cfg.train.profile_steps, Path(cfg.output_dir), reporter.print)
    run.model.train()
    saves = Saves(run, signals, reporter)
    run.compile_watch.begin()
    profiler.after_step(state.step)
    try:
        # Local SGD: no gradient all-reduce; parameters are averaged every K updates, and at the end.
        with run.update.local_sgd or nullcontext(), signals.deferred():
            while state.step < run.total_steps and not state.stopped_early:
                if _train_epoch(run, reporter, state, window, saves, profiler):
                    state.epoch, state.epoch_step = state.epoch + 1, 0
                    if cfg.eval.every_steps is None:
                        _log_eval(run, reporter, state)
                    if cfg.checkpoint.every_epoch:
                        saves.save(state, window)
            # A signal may still wait for an answer: one that came during the last evaluation, or an early stop's.
            saves.stop_or_save(state, window)
    finally:
        profiler.close(state.step)
    with run.compile_watch.host_work():
        tokens, token_context = window.totals()
    state.tokens += tokens
    return run.model_flops.total(tokens, token_context)


def _train_epoch(run: Run, reporter: Reporter, state: TrainState, window: LossWindow, saves: Saves,
                 profiler: StepProfiler) -> bool:
    """The rest of the current epoch (or until the run stops); returns whether the epoch completed."""
    cfg = run.cfg
    accum = cfg.train.gradient_accumulation_steps
    batches, done, micro_per_epoch = run.data.epoch_batches(run.accelerator, run.mesh, state.epoch, state.epoch_step)
    step_batches = []
    for micro, batch in enumerate(run.clock.timed(batches), start=done):
        if micro >= micro_per_epoch:  # the tail that does not fill an accumulation window
            break
        step_batches.append(run.mesh.shard_batch(batch))
        if len(step_batches) < accum:
            continue
        run.update.begin(state.step + 1)
        with profiler.step(state.step + 1):
            result = run.train_step(run.context, step_batches)
        step_batches = []
        state.skipped_steps, state.skipped_in_a_row = run.update.skip_counts
        if not run.update.skipped:
            window.add(result)
        else:  # its loss is not finite: kept out of the logged mean, its examples not shown
            window.skip()
            reporter.print(f"warning: step {state.step + 1} skipped: its gradient norm is not finite (train.on_"
                           f"nonfinite: skip; {state.skipped_in_a_row} in a row, {state.skipped_steps} in all)")
        state.step += 1
        state.epoch_step += 1
        state.epoch = run.data.epoch(state.epoch)
        reporter.step()
        if state.step % cfg.train.log_every == 0 or state.step == run.total_steps:
            with run.compile_watch.host_work():
                _log_train(run, reporter, state, window)
        if cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0:
            _log_eval(run, reporter, state)
        if run.harness is not None and run.harness.due(state.step):
            with run.compile_watch.host_work(), run.clock.phase("eval"), \
                    backend.generating(run.accelerator, run.model, run.mesh) as model:
                _log_harness(run, reporter, state, model)
        saves.after_step(state, window)
        profiler.after_step(state.step)
        if state.step >= run.total_steps or state.stopped_early:
            return micro == micro_per_epoch - 1
    return True


def _save_checkpoint(run: Run, state: TrainState, window: LossWindow) -> None:
    snapshot = window.snapshot(run.cfg.train.gradient_accumulation_steps)
    unlogged = snapshot["loss_total"] / snapshot["targets_total"] if snapshot["targets_total"] else None
    health.check_finite(run.accelerator, run.model, unlogged, state.step)  # never a non-finite checkpoint
    saved = dict(asdict(state), window=snapshot, tokens=state.tokens + window.totals()[0])
    checkpoint.save(run.accelerator, run.model, run.update.optimizer, Path(run.cfg.output_dir), saved,
                    run.cfg.checkpoint.keep_last, state.best_step, recipe=to_dict(run.cfg),
                    layout=layout(run.cfg, run.accelerator, run.mesh, run.replicas), loader_state=run.data.loader_state())


def _log_train(run: Run, reporter: Reporter, state: TrainState, window: LossWindow) -> None:
    if not window.micro_steps:  # every step since the last log was skipped (train.on_nonfinite: skip)
        return
    closed = window.close()
    state.last_loss = closed.loss
    steps = closed.micro_steps / run.cfg.train.gradient_accumulation_steps
    speed = steps * run.plan["effective_batch"] / closed.seconds
    record = {"step": state.step, "epoch": state.epoch, "loss": closed.loss,
              "lr": run.update.scheduler.get_last_lr()[0],
              "samples_per_second": speed, "tokens_per_second": closed.tokens / closed.seconds, **closed.metrics}
    if closed.examples:
        record["examples"] = closed.examples
    if run.peak_flops:
        record["mfu"] = closed.flops / closed.seconds / run.peak_flops
    if run.update.skips is not None:
        record["skipped_steps"] = state.skipped_steps
    xla = backend.xla_stats(run.accelerator)
    if xla is not None:  # the graphs compiled so far: flat after the first steps when the shapes are static
        record["xla/compiles"] = xla["compiles"]
    reporter.log(record)
    health.check_finite(run.accelerator, None, closed.loss, state.step)  # logged, then the run stops
    reporter.show_speed(closed.loss, speed, record["tokens_per_second"])
    warning = run.compile_watch.check(state.step)
    if warning:
        reporter.print(f"warning: {warning}")


def _log_eval(run: Run, reporter: Reporter, state: TrainState) -> None:
    """Evaluate; with eval.metric, keep the best model in model/ and count evaluations without progress."""
    # Evaluating, and saving the best model, read the device.
    with run.compile_watch.host_work(), run.clock.phase("eval"):
        results = evaluate(run)
        state.evals.append({"step": state.step, **results})
        reporter.log({"step": state.step, "epoch": state.epoch, **{f"eval_{k}": v for k, v in results.items()}})
        metric = run.cfg.eval.metric
        if metric is None:
            return
        greater = run.cfg.eval.greater_is_better
        greater = run.task.task.greater_is_better(metric) if greater is None else greater
        value = results[metric]
        if state.best_value is None or (value > state.best_value if greater else value < state.best_value):
            state.best_step, state.best_value, state.evals_without_improvement = state.step, value, 0
            _save_model(run, state.step)
            return
        state.evals_without_improvement += 1
        patience = run.cfg.train.early_stopping_patience
        if patience and state.evals_without_improvement >= patience:
            state.stopped_early = True
            reporter.print(f"early stopping at step {state.step}: eval {metric} has not improved for {patience} "
                           f"evaluations (best {state.best_value:.4g} at step {state.best_step})")


def _log_harness(run: Run, reporter: Reporter, state: TrainState, model: torch.nn.Module) -> None:
    """lm-evaluation-harness on ``model``, on every process (framework/harness.py says why); the main logs it."""
    result = run.harness.evaluate(model, run.tokenizer)
    state.harness = {"step": state.step, **result}
    reporter.log({"step": state.step, **harness.scalars(result)})


def _save_model(run: Run, step: int) -> None:
    health.check_finite(run.accelerator, run.model, None, step)  # no model/ of non-finite weights
    merge = run.cfg.peft is not None and run.cfg.peft.merge
    checkpoint.save_model(run.accelerator, run.model, run.tokenizer, Path(run.cfg.output_dir) / "model", run.mesh,
                          merge)


def evaluate(run: Run) -> Dict[str, float]:
    """Metrics over the whole eval set, each example counted once whatever the process count:
    ``gather_for_metrics`` drops the duplicates that even sharding adds to the last batch, and the
    ``valid`` mask drops the filler rows that static shapes add to it."""
    acc, model = run.accelerator, run.model
    model.eval()
    parts = defaultdict(list)
    with torch.no_grad(), backend.large_buffers_unmapped():
        for batch in run.data.eval_dl:
            batch = run.mesh.shard_batch(batch)
            valid = batch.pop("valid", None)
            outputs = run.task.eval_outputs(model, batch)
            if valid is not None:
                outputs["valid"] = valid
            for key, value in backend.gather_for_metrics(acc, outputs).items():
                parts[key].append(value)
    model.train()
    # One sync and host transfers at the end, rather than one per batch.
    gathered = {key: np.concatenate(backend.to_host(acc, values)) for key, values in parts.items()}
    if "valid" in gathered:
        keep = gathered.pop("valid").astype(bool)
        gathered = {key: value[keep] for key, value in gathered.items()}
    return run.task.metrics(gathered)


def format_plan(plan: Dict[str, object]) -> str:
    lines = [f"  {key}: {value}" for key, value in plan.items() if key != "notes" and value is not None]
    lines += [f"  note: {note}" for note in plan["notes"]]
    return "plan:\n" + "\n".join(lines)


def train(cfg: RunConfig, dry_run: bool = False, signals: Optional[Signals] = None) -> Optional[Dict]:
    """The whole run; returns the summary (None for a dry run). ``signals``: the CLI's handlers, installed
    for the whole run; without them a signal is handled only inside the training loop. However it ends, what the
    run built is freed before this returns (backend.release)."""
    started = time.perf_counter()
    noise.silence()
    run = setup(cfg)
    accelerator = run.accelerator
    finished = False
    try:
        summary = _run(run, started, dry_run, signals)
        finished = True
        return summary
    finally:
        del run
        backend.release(accelerator, finished)


def _final_harness(run: Run, reporter: Reporter, state: TrainState, model: torch.nn.Module, summary: dict) -> None:
    """The harness's figures at the last step (run now unless an evaluation there ran them), into the summary."""
    if state.harness is None or state.harness["step"] != state.step:
        _log_harness(run, reporter, state, model)
    summary["harness"] = state.harness


def _run(run: Run, started: float, dry_run: bool, signals: Optional[Signals]) -> Optional[Dict]:
    cfg, acc = run.cfg, run.accelerator
    out = Path(cfg.output_dir)
    device_bytes = backend.total_memory_bytes(acc)
    if acc.is_main_process:
        print(format_plan(run.plan), flush=True)
        print(memory.format_plan(run.memory_plan), flush=True)
        warning = memory.capacity_warning(run.memory_plan, device_bytes)
        if warning:
            print(f"warning: {warning}", flush=True)
    refusal = memory.generation_refusal(run.memory_plan, device_bytes)
    if refusal:  # on every process: each reads the same device
        raise UserError(refusal)
    if dry_run:
        return None

    state, start = TrainState(), run.start
    loading = time.perf_counter()
    if start.resume_from is not None:
        state = TrainState(**checkpoint.load(acc, run.model, run.update.optimizer, start.resume_from))
        run.data.resume(acc, start.resume_from)
        run.update.skip_counts = state.skipped_steps, state.skipped_in_a_row
    loading = time.perf_counter() - loading
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        for folder in (out, out / "checkpoints"):  # what an earlier run stopped mid-write left
            disk.remove_partial(folder)
        if start.clear:
            checkpoint.clear_previous_outputs(out)
        if start.continues_log:
            checkpoint.truncate_metrics(out, asdict(state))
        write_text(out / "config.yaml", to_yaml(cfg))
    # Once per machine, each resumes (accelerate's local index is -1 for an XLA process started without a launcher).
    if start.resume_from is not None and (acc.is_main_process or acc.local_process_index == 0):
        print(f"resuming from {start.resume_from}: step {state.step}, epoch {state.epoch} "
              f"(step {state.epoch_step} of {run.data.steps_per_epoch})", flush=True)
    acc.wait_for_everyone()
    if cfg.report_to:  # the hyperparameters once, as one flat mapping
        acc.init_trackers(checkpoint.TRACKER_PROJECT, config=hyperparameters(to_dict(cfg)),
                          init_kwargs=tracker_options(out, cfg.report_to))

    first_step, first_tokens = state.step, state.tokens
    page = LivePage(out, {"plan": run.plan, "memory_plan": run.memory_plan}, cfg.report.every_minutes,
                    run.clock) if cfg.report.enabled and acc.is_main_process else None
    reporter = Reporter(acc, out, run.total_steps, initial_step=state.step, page=page)
    fit_start = time.perf_counter()
    try:
        model_flops = fit(run, reporter, state, signals or Signals())
    except (checkpoint.Preempted, health.Diverged, UserError):
        if page is not None:  # the page shows where the run stopped
            page.write()
        raise
    finally:
        reporter.close()
    fit_seconds = time.perf_counter() - fit_start
    fit_time = run.clock.breakdown(fit_seconds)  # before the final evaluation adds to it
    if not state.evals or state.evals[-1]["step"] != state.step:
        _log_eval(run, reporter, state)
    if cfg.eval.metric is None:  # otherwise model/ already holds the best model
        _save_model(run, state.step)

    samples = (state.step - first_step) * run.plan["effective_batch"]  # trained by this invocation
    summary = {
        "train": {
            "steps": state.step,
            "samples": state.step * run.plan["effective_batch"],
            "loss": state.last_loss,
            "samples_per_second": samples / fit_seconds,
            "tokens_per_second": (state.tokens - first_tokens) / fit_seconds,
            "wall_seconds": fit_seconds,
            "resumed_from_step": first_step or None,
            "resume_load_seconds": loading if start.resume_from is not None else None,
            "stopped_early": state.stopped_early,
            "skipped_steps": state.skipped_steps if cfg.train.on_nonfinite == "skip" else None,
        },
        "eval": {k: v for k, v in state.evals[-1].items() if k != "step"},
        "backend": run.plan["backend"],
        "device": run.plan["device"],
        "num_processes": acc.num_processes,
        "precision": acc.mixed_precision,
        "memory": memory.measured(backend.unwrap(acc, run.model, run.mesh), run.update.optimizer.optimizer,
                                  backend.peak_memory_bytes(acc), held=backend.held_bytes(acc, run.mesh)),
        "memory_plan": run.memory_plan,
        "mfu": model_flops / fit_seconds / run.peak_flops if run.peak_flops else None,
        "flops": {"trained": model_flops, "per_second": model_flops / fit_seconds,
                  "peak_per_second": run.peak_flops},
        "plan": run.plan,
    }
    if cfg.eval.metric is not None:
        summary["best"] = {"step": state.best_step, "metric": cfg.eval.metric, "value": state.best_value}
    xla = backend.xla_stats(acc)
    if xla is not None:
        summary["xla"] = {**xla, "warning": run.compile_watch.warning,
                          "transfers_in_steps": run.compile_watch.transfers_in_steps}
    # Every process generates (the same greedy tokens), so sharded models (FSDP, DeepSpeed) run their
    # collectives together; on XLA after the XLA figures, on a host copy (backend.generating) unless the task
    # generates with static shapes (then on the device, and the harness on a host copy of its own).
    static = run.task.static_generation
    with backend.generating(acc, run.model, run.mesh, static) as model:
        sample = run.task.sample(model, run.tokenizer, run.data.eval_ds)
        if sample is not None:
            summary["sample"] = sample
            if acc.is_main_process:
                print(f"sample: {sample['prompt']!r} -> {sample['generated']!r}", flush=True)
        if run.harness is not None and not static:  # on the model the sample came from (on XLA: its host copy)
            _final_harness(run, reporter, state, model, summary)
    if run.harness is not None and static:
        with backend.generating(acc, run.model, run.mesh) as model:
            _final_harness(run, reporter, state, model, summary)
    wall = time.perf_counter() - started
    summary["wall_seconds"] = wall  # setup, the loop's parts and the finish (evaluation, saving) add up to it
    summary["time"] = {"setup": fit_start - started, **fit_time, "finish": wall - (fit_start - started) - fit_seconds}
    if acc.is_main_process:
        failed = _export(cfg, summary)
        write_json(out / "summary.json", summary)
        card.write_card(out / "model", to_dict(cfg), summary, files=[out / name for name in summary["exports"].values()])
        if cfg.report.enabled:
            write_report(out)
        if failed is not None:
            raise failed
        metric = run.task.task.metric
        print(f"done: eval {metric} {summary['eval'][metric]:.4f}, outputs in {out}")
    return summary


def _export(cfg: RunConfig, summary: Dict) -> Optional[UserError]:
    """The GGUF files ``export.gguf`` asks for, written from model/ beside it (framework/export.py), listed in the
    summary's ``exports`` (type -> file name). A model the writer refuses is returned, to be raised once summary.json
    and the card are written: the training outputs are complete, and the export can be run again by itself."""
    model_dir = Path(cfg.output_dir) / "model"
    summary["exports"] = {}
    for kind in dict.fromkeys(name.lower() for name in cfg.export.gguf):
        try:
            path = export.export_gguf(model_dir, kind, export.default_out(model_dir, kind))
        except UserError as e:
            return UserError(f"export.gguf: {e}. The run's other outputs are complete: once fixed, write the file with "
                             f"python -m framework.export {cfg.output_dir} --gguf {kind}")
        summary["exports"][kind] = path.name
        print(f"wrote {path} ({kind}: {export.KINDS[kind].about}; {disk.size_text(path.stat().st_size)})", flush=True)
    return None
