"""Tasks: everything that differs between what is trained, behind one interface.

A task is a :class:`Task` subclass registered under its recipe name (``@register("sft")``): the built-in ones,
one module each in this package, register when it is imported; a recipe may also name one outside the framework
as ``task: path/to/file.py:ClassName`` or ``task: package.module:ClassName`` (``get_task`` loads and registers it).
The loop, the devices, checkpoints and reports know nothing else about it.

A task declares (``Task``, one instance in the registry, holding nothing of a run):

- its recipe keys: ``options``, the ``(section, dataclass)`` of its own keys (``sft``: SftConfig), which the recipe
  layer (framework/recipe.py) adds to the schema; ``reads``, the task-specific keys (dotted, or whole sections, its
  own included) it reads: a key that another task reads and this one does not is refused when a recipe sets it,
  instead of being silently ignored; ``moved_from_data``: its keys once spelt ``data.KEY``, still read so;
  ``check(cfg, strategy)`` returns the problems of the keys it reads and of the strategy the run will have (FSDP,
  DeepSpeed, tensor parallelism, XLA), before anything is loaded;
- model loading: ``load(cfg, train, eval)`` -> (model, tokenizer), pretrained (``model.name_or_path``) or from a
  config (``model.config``); ``pipeline``: what the saved ``model/`` loads as in ``transformers.pipeline``;
  ``peft_task_type``: peft's task type for adapters on its model;
- data preparation: ``columns(cfg)`` (the columns its rows need; ``keeps_other_columns``: rows keep the data's
  other columns too, online RL's reward functions read them) and ``keep_row`` (which rows are usable),
  ``prepare(raw, tokenizer, model, cfg)`` -> features (tokenizing, labels, packing), ``sequence_length``,
  ``collator(...)``: features -> batches, in dynamic or static shapes; ``notes``: lines for the plan about the
  prepared data;
- its metrics' names (``metric_names``, the headline ``metric``, ``greater_is_better``), ``report_sections`` of
  report.html, and ``harness``: whether lm-evaluation-harness can score its model;
- ``step(cfg)``: the step the loop runs (framework/step.py): supervised micro-batches with accumulation unless the
  task brings its own (online RL, framework/tasks/online_rl/: generate, score, then update);
- ``bind(cfg, model, accelerator)``: the task bound to one run (``TaskRun``).

A run binds (``TaskRun``: the recipe's settings of its loss, and what it holds beside the trained model, such as a
frozen reference):

- its loss, returned as a sum with what it is normalised by: ``targets(batch)`` counts the batch's targets
  (examples, or target tokens) and ``loss_sum(model, batch)`` sums their losses. The supervised step divides by the
  targets of the whole optimizer step (every micro-batch, every process), so a token loss is exact whatever the
  accumulation and process count;
- ``eval_outputs(model, batch)``: per-example tensors, gathered across processes; ``metrics(gathered)``: the
  evaluation's figures (``loss`` always); ``sample(model, tokenizer, eval_ds)``: an optional human-readable sample
  for the log and summary (a generation);
- ``workload(model)``: what the memory plan counts of the task (sequence length, sequences per example, logits,
  frozen models, what it generates).
"""

from framework.tasks.base import (MODEL_ERRORS, ReportSection, Task, TaskRun, get_task, register, registered,
                                  sections, task_keys)

# The built-in tasks register themselves.
from framework.tasks import text_classification, causal_lm, masked_lm, sft, dpo, reward_model, grpo, rloo  # noqa: E402,F401,E501  isort: skip

__all__ = ["MODEL_ERRORS", "ReportSection", "Task", "TaskRun", "get_task", "register", "registered", "sections",
           "task_keys"]
