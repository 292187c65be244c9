"""Tasks: everything that differs between what is trained, behind one interface.

A task is a :class:`Task` subclass registered under its recipe name (``@register("sft")``): the built-in ones,
one module each in this package, register when it is imported; a recipe may also name one outside the framework
as ``task: path/to/file.py:ClassName`` or ``task: package.module:ClassName`` (``get_task`` loads and registers it).
The loop, the devices, checkpoints and reports know nothing else about it. A task owns:

- its recipe keys: ``options``, the ``(section, dataclass)`` of its own keys (``sft``: SftConfig), which
  framework/config.py adds to the schema; ``reads``, the task-specific keys (dotted, or whole sections, its own
  included) it reads: a key that another task reads and this one does not is refused when a recipe sets it,
  instead of being silently ignored; ``check(cfg)`` returns the problems of the keys it reads (or refuses),
  like the config core;
- model loading: ``load(cfg, raw)`` -> (model, tokenizer), pretrained (``model.name_or_path``) or from a
  config (``model.config``); ``pipeline``: what the saved ``model/`` loads as in ``transformers.pipeline``;
- data preparation: ``columns(cfg)`` (the columns its rows need) and ``keep_row`` (which rows are usable),
  ``prepare(raw, tokenizer, model, cfg)`` -> features (tokenizing, labels, packing), and ``collator(...)``:
  features -> batches, in dynamic or static shapes;
- its loss, returned as a sum with what it is normalised by: ``targets(batch)`` counts the batch's targets
  (examples, or target tokens) and ``loss_sum(model, batch)`` sums their losses. The loop divides by the
  targets of the whole optimizer step (every micro-batch, every process), so a token loss is exact whatever
  the accumulation and process count; ``logits_chunk(model)``: what the memory plan counts of the logits; ``workload(cfg, model)``: what the memory plan counts
  of the task (sequence length, sequences per example, logits, frozen models);
- ``eval_outputs(model, batch)``: per-example tensors, gathered across processes; ``metrics(gathered)``: the
  evaluation's figures (``loss`` always); ``metric``: the headline one, with ``greater_is_better(name)``;
- ``notes(cfg, train_ds, eval_ds)``: lines for the plan about the prepared data (rows it dropped or truncated);
- ``sample(model, tokenizer, cfg, eval_ds)``: an optional human-readable sample for the log and summary (a generation);
  ``report_sections(output_dir, summary, plots_dir)``: its own sections of report.html (classification's per-class
  table and confusion matrix);
- ``for_run(model, accelerator, cfg)``: the task as one run uses it: a copy holding the recipe's settings of its
  loss (language models' chunked loss) and what it needs beside the trained model (DPO's frozen reference, on the
  accelerator's device, which ``frozen_models()`` lists for the memory plan); the loop only ever calls the task.
- ``peft_task_type``: peft's task type for adapters on its model (``CAUSAL_LM``, ``SEQ_CLS``);
- ``step(cfg)``: the optimizer step the loop runs (framework/step.py): supervised micro-batches with accumulation
  unless the task brings its own (``grpo`` generates, scores, then updates);
- ``keeps_other_columns``: its rows keep every column of the data, not only ``columns(cfg)`` (``grpo`` passes
  them to its reward functions);
- ``harness``: whether its model is a causal LM that lm-evaluation-harness can score (``eval.harness``).
"""

from framework.tasks.base import (MODEL_ERRORS, ReportSection, Task, get_task, register, registered, sections,
                                  task_keys)

# The built-in tasks register themselves.
from framework.tasks import text_classification, causal_lm, masked_lm, sft, dpo, grpo  # noqa: E402,F401  isort: skip

__all__ = ["MODEL_ERRORS", "ReportSection", "Task", "get_task", "register", "registered", "sections", "task_keys"]
