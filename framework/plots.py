"""PNG figures of runs, drawn with matplotlib's Agg canvas (no display needed): the curves of one run or of
several overlaid, its memory (planned against measured) and where its time went.

matplotlib is imported inside the functions: a run that writes no report never pays for the import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

MIB = 2**20
# Panels of the curves figure: title, then (metrics.jsonl key, label, line style) drawn in it. After the loss and
# learning rate, each further quantity the steps log (a task's own: online RL's rewards, lengths, clipping) gets a
# panel, the keys sharing a prefix before "/" one panel together (TRL's names: completions/mean_length,
# completions/max_length), an evaluation figure of the same name in the same panel; then each other eval metric
# of the task (accuracy, f1, perplexity, ...), then the speed. Nothing here is specific to a task.
FIXED_PANELS = [
    ("loss", [("loss", "train", "-"), ("eval_loss", "eval", "--o")]),
    ("learning rate", [("lr", "lr", "-")]),
]
SPEED_PANELS = [
    ("tokens / s", [("tokens_per_second", "tokens/s", "-")]),
    ("samples / s", [("samples_per_second", "samples/s", "-")]),
    ("MFU (%)", [("mfu", "MFU", "-")]),
]
NOT_CURVES = {"step", "epoch", "skipped_steps"}  # a training record's keys that are no quantity to draw
SCALE = {"mfu": 100.0}  # shown as a percentage
COUNTS = {"eval_loss", "eval_examples", "eval_tokens", "eval_prompts"}  # no panel of their own: the loss has one,
# counts are no curve
STYLES = ["-", "--", ":", "-."]  # the lines of one run's panel that share its colour


def _figure(panels: int, width: float = 4.2, height: float = 2.9, left: float = 0.6):
    """A grid of ``panels`` axes, at most 4 a row; margins fixed in inches (a layout engine doubles the drawing
    time). ``left``: room for the tick labels of the first column."""
    from matplotlib.figure import Figure

    cols = min(panels, 4)
    rows = -(-panels // cols)
    fig = Figure(figsize=(width * cols, height * rows), dpi=90)
    w, h = width * cols, height * rows
    fig.subplots_adjust(left=left / w, right=1 - 0.15 / w, bottom=0.5 / h, top=1 - 0.35 / h, wspace=0.28,
                        hspace=0.55)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


def _panels(runs: Dict[str, List[dict]]) -> List[Tuple[str, list]]:
    """The panels that have data in at least one run (the order above)."""
    numbers = [{k for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for records in runs.values() for r in records]
    drawn = {key for _, lines in FIXED_PANELS + SPEED_PANELS for key, _, _ in lines} | NOT_CURVES
    logged = sorted({k for keys in numbers if "loss" in keys for k in keys} - drawn - COUNTS)
    evaluated = sorted({k for keys in numbers for k in keys if k.startswith("eval_")} - COUNTS)
    groups: Dict[str, list] = {}
    for key in logged:
        group, _, rest = key.partition("/")
        groups.setdefault(group, []).append((key, rest or "train"))
    for key in evaluated:
        group, _, rest = key[len("eval_"):].partition("/")
        if group in groups:  # eval_reward beside reward, eval_rewards/NAME beside rewards/NAME/mean
            groups[group].append((key, f"eval {rest}".strip() if rest else "eval"))
    panels = [(group, [(key, label, STYLES[i % len(STYLES)] if not label.startswith("eval") else "--o")
                       for i, (key, label) in enumerate(lines)]) for group, lines in groups.items()]
    own = [(key[len("eval_"):], [(key, "eval", "-o")]) for key in evaluated
           if key[len("eval_"):].partition("/")[0] not in groups]
    candidates = FIXED_PANELS + panels + own + SPEED_PANELS
    return [(title, lines) for title, lines in candidates if any(key in keys for keys in numbers for key, _, _ in lines)]


def curves(runs: Dict[str, List[dict]], path: Path) -> Optional[Path]:
    """The metrics.jsonl records of one run (or several, overlaid with a colour each) against the optimizer
    step, one panel per quantity; None (nothing written) while there is nothing to draw."""
    panels = _panels(runs)
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    colours = [f"C{i}" for i in range(len(runs))]
    last = max((r["step"] for records in runs.values() for r in records), default=1)
    for ax, (title, lines) in zip(axes, panels):
        for (name, records), colour in zip(runs.items(), colours):
            for key, label, style in lines:
                points = [(r["step"], r[key] * SCALE.get(key, 1.0)) for r in records
                          if isinstance(r.get(key), (int, float))]
                if points:
                    steps, values = zip(*points)
                    shown = label if len(runs) == 1 else f"{name} ({label})" if len(lines) > 1 else name
                    ax.plot(steps, values, style, color=colour, label=shown, markersize=3, linewidth=1.4)
        ax.set_title(title)
        ax.set_xlim(0, last * 1.03)  # every panel on the same steps, also one with a single evaluation
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1 or len(lines) > 1:
            ax.legend(fontsize=7)
    return _save(fig, path)


def harness(records: List[dict], path: Path) -> Optional[Path]:
    """The lm-evaluation-harness figures against the step, one panel per task (its metrics, without their
    standard errors, as lines); None (nothing written) unless the harness ran more than once."""
    runs = [r for r in records if any(k.startswith("harness/") for k in r)]
    if len(runs) < 2:
        return None
    tasks: Dict[str, List[str]] = {}
    for r in runs:
        for key in r:
            parts = key.split("/")
            if len(parts) == 3 and not parts[2].endswith("_stderr") and parts[2] != "samples":
                metrics = tasks.setdefault(parts[1], [])
                if parts[2] not in metrics:
                    metrics.append(parts[2])
    fig, axes = _figure(len(tasks))
    for ax, (task, metrics) in zip(axes, tasks.items()):
        for metric in metrics:
            points = [(r["step"], r[f"harness/{task}/{metric}"]) for r in runs if f"harness/{task}/{metric}" in r]
            ax.plot(*zip(*points), "-o", label=metric, markersize=3, linewidth=1.4)
        ax.set_title(f"harness: {task}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def confusion(matrix: List[List[int]], labels: List[str], path: Path) -> Path:
    """A confusion matrix (rows: the true class, columns: the predicted one), each cell with its count."""
    import numpy as np

    counts = np.asarray(matrix)
    size = max(3.2, 0.55 * len(labels) + 1.6)
    fig, (ax,) = _figure(1, width=size + 0.8, height=size, left=1.2)
    ax.imshow(counts, cmap="Blues")
    for (i, j), n in np.ndenumerate(counts):
        ax.text(j, i, str(n), ha="center", va="center", fontsize=8,
                color="white" if n > counts.max() / 2 else "black")
    ticks = list(range(len(labels)))
    ax.set_xticks(ticks, labels, rotation=45 if len(labels) > 4 else 0, fontsize=8)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("confusion matrix (eval)")
    return _save(fig, path)


def memory(plan: Dict[str, object], measured: Optional[Dict[str, int]], path: Path) -> Path:
    """Per-device memory: the plan's parts (estimated before training) next to what the run held (per device
    where the run read its shards)."""
    measured = {**measured, **measured.get("per_device", {})} if measured else measured
    parts = [("weights", "weight_bytes"), ("gradients", "gradient_bytes"), ("optimizer state", "optimizer_state_bytes"),
             ("activations", "activation_bytes"), ("logits", "logit_bytes")]
    labels = [label for label, key in parts if plan.get(key) or (measured or {}).get(key)] + ["total / peak"]
    planned = [(plan.get(key) or 0) / MIB for label, key in parts if label in labels] + [plan["total_bytes"] / MIB]
    held = [((measured or {}).get(key) or 0) / MIB for label, key in parts if label in labels]
    held.append(((measured or {}).get("peak_bytes") or 0) / MIB)
    fig, (ax,) = _figure(1, width=7.0, height=3.2, left=1.3)
    rows = range(len(labels))
    ax.barh([y + 0.2 for y in rows], planned, height=0.4, color="C0", label="plan (estimate)")
    if measured:
        ax.barh([y - 0.2 for y in rows], held, height=0.4, color="C1", label="measured (peak: process or allocator)")
    for y, (a, b) in enumerate(zip(planned, held)):
        ax.text(a, y + 0.2, f" {a:.0f}", va="center", fontsize=7)
        if measured:
            ax.text(b, y - 0.2, f" {b:.0f}", va="center", fontsize=7)
    ax.set_yticks(list(rows), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, max(planned + held) * 1.15)
    ax.set_xlabel("MiB per device")
    ax.set_title("memory")
    ax.legend(fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def time_breakdown(seconds: Dict[str, float], path: Path) -> Path:
    """Where the wall time went, one bar per part, labelled with its seconds and share."""
    fig, (ax,) = _figure(1, width=7.0, height=2.8, left=1.0)
    names = list(seconds)
    total = sum(seconds.values()) or 1.0
    ax.barh(names, [seconds[n] for n in names], color=[f"C{i}" for i in range(len(names))])
    for y, name in enumerate(names):
        ax.text(seconds[name], y, f" {seconds[name]:.1f} s ({100 * seconds[name] / total:.0f}%)", va="center",
                fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("time")
    ax.set_xlim(0, max(seconds.values() or [1.0]) * 1.35)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """Write under a temporary name, then rename: a reader never sees half an image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp_{path.name}")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return path
