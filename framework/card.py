"""The model card of a trained model: ``model/README.md`` in the Hugging Face Hub's format (YAML metadata, then
Markdown), so that the folder, uploaded as it is, says what it is and how it came to be: the task, the base model,
the data, the final figures, the evaluation, the resolved recipe, and the framework version and commit that trained
it. Built with huggingface_hub's ``ModelCard`` / ``ModelCardData``, which the Hub and ``ModelCard.load`` read back.

Metadata: ``base_model`` the nearest Hub model the run started from (``model.name_or_path`` when it is a Hub id;
for a local folder, the Hub id its config or its own card names, or its Hub-cache folder's), ``library_name``
transformers (peft for a folder holding only an adapter), ``pipeline_tag`` the task's, ``tags`` the project's,
the task's name (``sft``, ``dpo``, ``grpo`` as TRL tags its trainers' models) and lora for adapters,
``datasets`` the Hub datasets trained on (local files are named in the card's text: the Hub links dataset ids).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from huggingface_hub import ModelCard, ModelCardData
from omegaconf import OmegaConf

import framework
from framework.disk import size_text, write_text
from framework.tasks import get_task, registered

CARD = "README.md"
PROJECT_TAG = "accelerate-recipes"  # the framework's tag on the Hub: every model it trained carries it
ROOT = Path(__file__).resolve().parents[1]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
HUB_CACHE = re.compile(r"models--([\w.-]+)--([\w.-]+)")  # huggingface_hub's cache folder of org/name
LIBRARIES = ("torch", "transformers", "accelerate", "peft", "datasets", "tokenizers")


def write_card(model_dir: Path, recipe: Dict[str, Any], summary: Dict[str, Any], name: Optional[str] = None,
               files: Sequence[Path] = ()) -> Path:
    """Write ``model_dir/README.md`` (replacing one peft wrote) and return its path. ``recipe``: the resolved
    recipe as ``config.to_dict`` gives it (values from the environment already as their templates);
    ``summary``: the run's (``summary.json``); ``name``: the model's title (default the run's folder name);
    ``files``: other outputs to list with their sizes (the GGUF exports)."""
    model_dir = Path(model_dir)
    name = name or _run_name(model_dir)
    task = recipe.get("task", "?")
    data = ModelCardData(model_name=name, base_model=base_model(recipe), library_name=_library(model_dir),
                         pipeline_tag=_pipeline(task), tags=_tags(recipe), datasets=hub_datasets(recipe) or None)
    body = "\n\n".join([
        f"# {name}",
        _intro(recipe),
        "## Task\n\n" + _task_text(task),
        "## Data\n\n" + _data_text(recipe, summary),
        "## Results\n\n" + _results_text(summary),
        "## Evaluation\n\n" + _evaluation_text(recipe, summary),
        "## Recipe\n\nThe resolved recipe (every key, defaults included; values from the environment as their "
        "`${oc.env:...}` templates). Trained with `accelerate launch recipes/run.py --config config.yaml`:\n\n"
        f"```yaml\n{_recipe_yaml(recipe)}```",
        *(["## Files\n\n" + _files_text(files)] if files else []),
        "## Framework\n\n" + _framework_text(),
    ])
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")
    path = model_dir / CARD
    write_text(path, str(card))
    return path


def _run_name(model_dir: Path) -> str:
    model_dir = model_dir.absolute()
    return model_dir.parent.name if model_dir.name == "model" else model_dir.name


def is_hub_id(name: str) -> bool:
    """``org/name`` or ``name`` as the Hub spells repository ids, and no local path."""
    return bool(HUB_ID.fullmatch(name)) and not Path(name).exists() and not name.endswith(".gguf")


def base_model(recipe: Dict[str, Any]) -> Optional[str]:
    """The nearest Hub model the run started from, or None (trained from scratch, or from local weights alone)."""
    name = (recipe.get("model") or {}).get("name_or_path")
    if not name:
        return None
    if is_hub_id(name):
        return name
    folder = Path(name).expanduser()
    if not folder.is_dir():  # a GGUF file: it names no Hub repository transformers could load
        return None
    config = folder / "config.json"
    named = json.loads(config.read_text()).get("_name_or_path") if config.is_file() else None
    if isinstance(named, str) and is_hub_id(named):  # written by transformers 4 from a Hub model
        return named
    if (folder / CARD).is_file():  # a model/ this framework trained, or one downloaded with its card
        found = ModelCard.load(folder / CARD).data.base_model
        if isinstance(found, str):
            return found
    cached = HUB_CACHE.search(str(folder.resolve()))
    return f"{cached.group(1)}/{cached.group(2)}" if cached else None


def hub_datasets(recipe: Dict[str, Any]) -> List[str]:
    """The Hub datasets the run trained on: ``data.dataset`` and each source's (``data.sources``)."""
    data = recipe.get("data") or {}
    names = [data.get("dataset")] + [s.get("dataset") for s in data.get("sources") or []]
    return list(dict.fromkeys(n for n in names if n))


def _library(model_dir: Path) -> str:
    adapter_only = (model_dir / "adapter_config.json").is_file() and not (model_dir / "config.json").is_file()
    return "peft" if adapter_only else "transformers"


def _task(task: str):
    """The registered task (a name a recipe may give), or None for one loaded from user code."""
    return get_task(task) if task in registered() else None


def _pipeline(task: str) -> Optional[str]:
    found = _task(task)
    return getattr(found, "pipeline", None) if found is not None else None


def _tags(recipe: Dict[str, Any]) -> List[str]:
    tags = [PROJECT_TAG, recipe.get("task", "?")]
    if recipe.get("peft"):
        tags += ["lora", "peft"]
    return tags


def _intro(recipe: Dict[str, Any]) -> str:
    model = recipe.get("model") or {}
    start = (f"from `{model['name_or_path']}`" if model.get("name_or_path") else
             f"from scratch (a new {(model.get('config') or {}).get('model_type', 'model')})")
    adapters = " with LoRA adapters" if recipe.get("peft") else ""
    merged = " (merged into the weights)" if (recipe.get("peft") or {}).get("merge") else ""
    return (f"Trained {start}{adapters}{merged} by task `{recipe.get('task')}` of the framework "
            f"(`{PROJECT_TAG}`, version {framework.__version__}), seed {recipe.get('seed')}.")


def _task_text(task: str) -> str:
    found = _task(task)
    if found is None:
        return f"`{task}`: a task from the user's own code."
    doc = (sys.modules[type(found).__module__].__doc__ or "").strip()
    first = " ".join(doc.split("\n\n")[0].split())
    pipeline = getattr(found, "pipeline", None)
    loads = f" It loads in `transformers.pipeline(\"{pipeline}\")`." if pipeline else ""
    return f"`{task}`: {first}{loads}"


def _files(value: Any) -> List[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _data_text(recipe: Dict[str, Any], summary: Dict[str, Any]) -> str:
    data = recipe.get("data") or {}
    lines = []
    for path in _files(data.get("train_file")):
        lines.append(f"- training file: `{path}`")
    if data.get("dataset"):
        config = f" (configuration `{data['dataset_config']}`)" if data.get("dataset_config") else ""
        lines.append(f"- Hub dataset: [{data['dataset']}](https://huggingface.co/datasets/{data['dataset']})"
                     f"{config}, split `{data.get('train_split', 'train')}`")
    for source in data.get("sources") or []:
        where = source.get("dataset") or ", ".join(f"`{p}`" for p in _files(source.get("train_file")))
        lines.append(f"- source: {where} (weight {source.get('weight', 1)})")
    if data.get("eval_file"):
        lines.append(f"- evaluation file: `{data['eval_file']}`")
    elif data.get("eval_split"):
        lines.append(f"- evaluation split: `{data['eval_split']}`")
    elif data.get("eval_fraction"):
        lines.append(f"- evaluation: {data['eval_fraction']:g} of the training rows held out (seeded)")
    plan = summary.get("plan") or {}
    if "train_examples" in plan:
        lines.append(f"- examples: {plan['train_examples']} to train on, {plan.get('eval_examples', '?')} to evaluate")
    if data.get("max_train_samples"):
        lines.append(f"- at most {data['max_train_samples']} training rows (`data.max_train_samples`)")
    return "\n".join(lines) or "No data named in the recipe."


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs:.0f} s" if minutes else f"{secs:.1f} s"


def _table(rows: Iterable[tuple]) -> str:
    return "\n".join(["| figure | value |", "| --- | --- |"] + [f"| {k} | {_number(v)} |" for k, v in rows])


def _results_text(summary: Dict[str, Any]) -> str:
    train = summary.get("train") or {}
    plan = summary.get("plan") or {}
    rows = [("train loss (last logged)", train.get("loss")), ("optimizer steps", train.get("steps")),
            ("samples trained on", train.get("samples")), ("epochs", plan.get("epochs")),
            ("effective batch", plan.get("effective_batch")),
            ("wall time (whole run)", _duration(summary.get("wall_seconds"))),
            ("training time", _duration(train.get("wall_seconds"))),
            ("samples / s", train.get("samples_per_second")), ("tokens / s", train.get("tokens_per_second"))]
    # The scalar figures: per-class tables and confusion matrices are in summary.json and report.html.
    rows += [(f"eval {k}", v) for k, v in (summary.get("eval") or {}).items() if isinstance(v, (int, float))]
    if summary.get("mfu") is not None:
        rows.append(("MFU", summary["mfu"]))
    notes = [f"stopped early ({train['stopped_early']})"] if train.get("stopped_early") else []
    if train.get("resumed_from_step"):
        notes.append(f"resumed from step {train['resumed_from_step']}")
    where = (f"On {summary.get('num_processes', 1)} process(es), backend {summary.get('backend', '?')} "
             f"({summary.get('device', '?')}), mixed precision: {summary.get('precision', '?')}"
             + (f"; {'; '.join(notes)}" if notes else "") + ".")
    return f"{where}\n\n{_table((k, v) for k, v in rows if v is not None)}"


def _evaluation_text(recipe: Dict[str, Any], summary: Dict[str, Any]) -> str:
    parts = ["The eval figures above are over the whole evaluation set (see Data) after the last step."]
    best = summary.get("best")
    if best:
        parts[0] = (f"`model/` holds the best model by eval `{best['metric']}`: {_number(best['value'])} at step "
                    f"{best['step']}; the eval figures above are the last evaluation's.")
    harness = summary.get("harness")
    if harness:
        rows = [f"| {task} | " + ", ".join(f"{k} {_number(v)}" for k, v in figures.items()) + " |"
                for task, figures in (harness.get("tasks") or {}).items()]
        parts.append(f"lm-evaluation-harness at step {harness.get('step')}:\n\n| task | figures |\n| --- | --- |\n"
                     + "\n".join(rows))
    sample = summary.get("sample")
    if sample:
        parts.append(f"A greedy sample after training:\n\n- prompt: `{sample.get('prompt')!r}`\n"
                     f"- generated: `{sample.get('generated')!r}`")
    if not summary.get("eval") and not harness:
        parts = ["Not evaluated (no evaluation set)."]
    return "\n\n".join(parts)


def _recipe_yaml(recipe: Dict[str, Any]) -> str:
    """The recipe as YAML, as the run's config.yaml has it; a Hub token given in clear is never written out."""
    recipe = json.loads(json.dumps(recipe, default=str))
    model = recipe.get("model") or {}
    if model.get("token") and "${" not in str(model["token"]):
        model["token"] = "<withheld>"
    return OmegaConf.to_yaml(OmegaConf.create(recipe), sort_keys=False)


def _files_text(files: Sequence[Path]) -> str:
    return "\n".join(f"- `{Path(f).name}` ({size_text(Path(f).stat().st_size)})" for f in files if Path(f).is_file())


def git_commit() -> str:
    """The commit of the framework's checkout, marked when it has uncommitted changes; "unknown" outside one."""
    if not (ROOT / ".git").exists():  # installed, not a checkout: a repository around it is someone else's
        return "unknown"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def _framework_text() -> str:
    versions = []
    for name in LIBRARIES:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return (f"- framework version: {framework.__version__}\n- git commit: {git_commit()}\n"
            f"- Python {sys.version.split()[0]}; {', '.join(versions)}")
