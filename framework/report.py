"""What a run tells the user: the progress bar, metrics.jsonl and the trackers while it trains, where its time
went, and its report: ``output_dir/report.html`` with PNG plots in ``output_dir/plots/``, rewritten while the run
trains (every ``report.every_minutes``) and at its end.

    python -m framework.report RUN                  # write RUN's report again from its files
    python -m framework.report RUN RUN [...] [--out DIR]   # compare runs: differing recipe keys, final
                                                    # figures side by side, the curves overlaid in one PNG
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

from framework import plots
from framework.disk import WriteFailed, append_line, write_text, writing
from framework.config import flatten
from framework.errors import UserError
from framework.trackers import TRACKER_PACKAGES
from framework.tasks import get_task

PAGE = "report.html"
EXAMPLE_STEPS = 5  # logged steps whose examples (StepResult.examples) the report shows
PLOTS = "plots"


def read_records(output_dir: Path) -> List[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------- while the run trains


class Clock:
    """Where the training loop's wall time goes, timed on the host without a device sync of its own: waiting
    for the next batch (``data``), evaluating (and saving the best model), saving checkpoints, writing the
    report. What is left is ``compute``: issuing forward, backward and optimizer steps and, where the device
    runs behind the host (GPU, XLA), waiting for it at the loop's own sync points (the log steps)."""

    PHASES = ("data", "eval", "checkpoint", "report")

    def __init__(self):
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._current: Optional[str] = None  # the phase being timed; a nested one pauses it
        self._since = 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        outer, now = self._current, time.perf_counter()
        if outer is not None:
            self.seconds[outer] += now - self._since
        self._current, self._since = name, now
        try:
            yield
        finally:
            now = time.perf_counter()
            self.seconds[name] += now - self._since
            self._current, self._since = outer, now

    def timed(self, batches: Iterable) -> Iterator:
        """The batches, the wait for each counted as ``data``."""
        iterator, end = iter(batches), object()
        while True:
            with self.phase("data"):
                batch = next(iterator, end)
            if batch is end:
                return
            yield batch

    def breakdown(self, fit_seconds: float) -> Dict[str, float]:
        """Seconds per part of the training loop; they add up to ``fit_seconds``."""
        compute = max(0.0, fit_seconds - sum(self.seconds.values()))
        return {"data": self.seconds["data"], "compute": compute,
                **{name: self.seconds[name] for name in self.PHASES[1:]}}


class LivePage:
    """The report of a run in progress, rewritten from metrics.jsonl at log steps: at most every
    ``every_minutes``, and no more often than keeps drawing it under ``SHARE`` of the training time (the
    plots take about a second on a small CPU, the first drawing, with matplotlib's import, nearly two: there
    the page is rewritten every 2-3 minutes instead of every minute)."""

    SHARE = 0.01

    def __init__(self, output_dir: Path, facts: Dict[str, object], every_minutes: float, clock: Clock):
        self.output_dir, self.facts, self.clock = output_dir, facts, clock
        self.seconds = every_minutes * 60
        self.last = time.monotonic()
        self.cost = 0.0  # how long the last drawing took

    def due(self) -> None:
        if time.monotonic() - self.last >= max(self.seconds, self.cost / self.SHARE):
            self.write()

    def write(self) -> None:
        started = time.monotonic()
        with self.clock.phase("report"):
            write_report(self.output_dir, live=self.facts)
        self.last = time.monotonic()
        self.cost = self.last - started


class Reporter:
    """Logs from the main process only; every other process holds a silent one."""

    def __init__(self, accelerator, output_dir: Path, total_steps: int, initial_step: int = 0,
                 page: Optional[LivePage] = None):
        from tqdm.auto import tqdm

        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.metrics_path = output_dir / "metrics.jsonl"
        # Lines of metrics.jsonl so far (a resumed run's kept ones too), recorded in each checkpoint: a resume keeps
        # exactly those, also when an evaluation logged after a checkpoint at the same step.
        self.lines = len(read_records(output_dir)) if self.main else 0
        self.page = page if self.main else None
        # tqdm's own postfix shows elapsed time and the ETA from the steps' rate.
        self.bar = tqdm(total=total_steps, initial=initial_step, disable=not self.main, desc="train",
                        unit="step", dynamic_ncols=True)

    def step(self) -> None:
        self.bar.update(1)

    def log(self, record: Dict) -> None:
        """One line of metrics.jsonl (every record has ``step``), mirrored to the trackers."""
        if not self.main:
            return
        append_line(self.metrics_path, json.dumps(record))
        self.lines += 1
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        self.accelerator.log(numbers, step=record["step"])
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
                         if not isinstance(v, (dict, list)))  # per-class figures: in summary.json and the report
        self.bar.write(shown)
        if self.page is not None:
            self.page.due()

    def show_speed(self, loss: float, samples_per_second: float, tokens_per_second: float) -> None:
        self.bar.set_description_str(f"train loss {loss:.4f}", refresh=False)
        self.bar.set_postfix_str(f"{samples_per_second:.1f} samples/s, {tokens_per_second:.0f} tokens/s",
                                 refresh=False)

    def print(self, text: str) -> None:
        if self.main:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()


def check_trackers(trackers: Sequence[str]) -> None:
    """Refuse a tracker whose package is not installed, before any slow work."""
    import importlib.util

    for name in trackers:
        if not any(importlib.util.find_spec(module) for module in TRACKER_PACKAGES[name]):
            raise UserError(f"report_to: {name} is not installed; `pip install {TRACKER_PACKAGES[name][0]}`, or "
                            "remove it from report_to")


def hyperparameters(recipe: Dict[str, object]) -> Dict[str, object]:
    """The resolved recipe as one flat mapping for the trackers (``optim.lr``: 5e-05): numbers, strings, booleans
    and nulls as they are, lists and mappings as JSON text (what every tracker's hyperparameter table takes)."""
    return {key: value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)
            for key, value in flatten(recipe).items()}


def tracker_options(output_dir: Path, trackers: Sequence[str]) -> Dict[str, dict]:
    """Each tracker's init arguments that keep its files in ``output_dir``: wandb's run folder
    (``output_dir/wandb``; offline with WANDB_MODE=offline); mlflow's store, a SQLite file
    (``output_dir/mlflow/mlflow.db``, mlflow's file store is retired), unless MLFLOW_TRACKING_URI names another.
    tensorboard writes into ``output_dir`` already (the project folder)."""
    options = {}
    if "wandb" in trackers:
        options["wandb"] = {"dir": str(output_dir)}
    if "mlflow" in trackers and not os.environ.get("MLFLOW_TRACKING_URI"):
        folder = output_dir.resolve() / "mlflow"
        folder.mkdir(parents=True, exist_ok=True)
        # accelerate's tracker reads mlflow's process-wide default store: set for this run's process.
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
        options["mlflow"] = {"logging_dir": str(folder / "artifacts")}
    return options


# ---------------------------------------------------------------- the report page


def _fmt(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _table(rows: Iterable[Sequence[object]], header: Optional[Sequence[str]] = None) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _mib(n: Optional[int]) -> str:
    return "" if n is None else f"{n / 2**20:.1f} MiB"


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}pre{background:#f7f7f7;padding:1em;overflow:auto}
.muted{color:#777}"""


def final_figures(output_dir: Path) -> Dict[str, object]:
    """The headline figures of a run: from summary.json when it finished, else its latest logged values."""
    summary = _read_json(output_dir / "summary.json")
    if summary is None:
        latest: Dict[str, object] = {}
        for record in read_records(output_dir):
            latest.update(record)
        return {"finished": False, **{k: v for k, v in latest.items() if k not in ("epoch", "examples")}}
    train = summary["train"]
    figures = {"finished": True, "step": train["steps"], "loss": train["loss"],
               **{f"eval_{k}": v for k, v in summary["eval"].items() if not isinstance(v, (dict, list))},
               "samples_per_second": train["samples_per_second"], "tokens_per_second": train["tokens_per_second"],
               "mfu": summary.get("mfu"), "train_seconds": train["wall_seconds"],
               "peak_memory": _mib(summary["memory"]["peak_bytes"])}
    return {k: v for k, v in figures.items() if v is not None}


def write_report(output_dir: Path, live: Optional[Dict[str, object]] = None) -> Path:
    """Write ``output_dir/report.html`` and its plots from the run's files: metrics.jsonl, config.yaml and, once
    the run finished, summary.json; while it trains, ``live`` holds what summary.json will (``plan``,
    ``memory_plan``). Returns the page's path."""
    records = read_records(output_dir)
    summary = _read_json(output_dir / "summary.json")
    facts = summary or live or {}
    folder = output_dir / PLOTS
    with writing(f"{PLOTS}/", output_dir):  # matplotlib writes each PNG in place
        images = _plots(output_dir, records, summary, facts, folder)
    sections = _task_sections(output_dir, summary, folder)
    write_text(output_dir / PAGE, _page(output_dir, records, summary, facts, images, sections))
    return output_dir / PAGE


def _plots(output_dir: Path, records: List[dict], summary: Optional[dict], facts: dict, folder: Path) -> list:
    images = []
    curves = plots.curves({output_dir.name: records}, folder / "curves.png")
    if curves:
        images.append(("curves", curves))
    if summary and summary.get("time"):
        images.append(("time", plots.time_breakdown(summary["time"], folder / "time.png")))
    if facts.get("memory_plan"):
        images.append(("memory", plots.memory(facts["memory_plan"], (summary or {}).get("memory"),
                                              folder / "memory.png")))
    harness_curve = plots.harness(records, folder / "harness.png")
    if harness_curve:
        images.append(("harness", harness_curve))
    return images


def _task_sections(output_dir: Path, summary: Optional[dict], folder: Path) -> list:
    """The sections a finished run's task adds (``Task.report_sections``: classification's per-class figures)."""
    config = output_dir / "config.yaml"
    if not summary or not config.exists():
        return []
    import yaml

    try:
        task = get_task(str((yaml.safe_load(config.read_text()) or {}).get("task")))
    except UserError:  # a task of the user's that cannot be loaded from here
        return []
    return task.report_sections(output_dir, summary, folder)


def _page(output_dir: Path, records: List[dict], summary: Optional[dict], facts: dict, images: list,
          sections: list) -> str:
    plan = facts.get("plan") or {}
    total = plan.get("total_steps")
    if summary:
        status = f"finished: {summary['train']['steps']} steps"
    else:
        last = max((r["step"] for r in records), default=0)
        status = f"not finished (in progress or stopped): step {last}" + (f" of {total}" if total else "")
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [f"<h1>{html.escape(output_dir.name)}</h1>",
             f"<p>{html.escape(status)} <span class='muted'>(written {stamp})</span></p>",
             "<h2>Final figures</h2>" if summary else "<h2>Latest figures</h2>",
             _table([(k, v) for k, v in final_figures(output_dir).items() if k != "finished"])]
    for name, path in images:
        if name == "curves":
            parts += ["<h2>Curves</h2>", f"<img src='{PLOTS}/{path.name}' alt='curves'>"]
    if summary and summary.get("time"):
        wall = summary["wall_seconds"]
        parts += ["<h2>Time</h2>", _table([(k, f"{v:.1f} s", f"{100 * v / wall:.1f}%") for k, v in
                                          summary["time"].items()], ["part", "seconds", "share of the run"]),
                  f"<img src='{PLOTS}/time.png' alt='time'>"]
    if plan:
        notes = plan.get("notes") or []
        parts += ["<h2>Plan</h2>", _table([(k, v) for k, v in plan.items() if k != "notes" and v is not None])]
        parts += ["<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"] if notes else []
    memory_plan = facts.get("memory_plan")
    if memory_plan:
        measured = (summary or {}).get("memory") or {}
        keys = ["weight_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes", "logit_bytes"]
        rows = [(k.replace("_bytes", ""), _mib(memory_plan.get(k)), _mib(measured.get(k))) for k in keys]
        rows.append(("total (plan) / peak (measured)", _mib(memory_plan["total_bytes"]),
                     _mib(measured.get("peak_bytes"))))
        parts += ["<h2>Memory per device</h2>", _table(rows, ["part", "plan (estimate)", "measured"]),
                  f"<img src='{PLOTS}/memory.png' alt='memory'>"]
    parts += _harness_section(summary, images)
    for section in sections:
        parts += [f"<h2>{html.escape(section.title)}</h2>", _table(section.rows, section.header)]
        parts += [f"<img src='{PLOTS}/{path.name}' alt='{html.escape(section.title)}'>" for path in section.plots]
    parts += _examples_section(records)
    if summary and summary.get("sample"):
        parts += ["<h2>Sample</h2>", _table([(summary["sample"]["prompt"], summary["sample"]["generated"])],
                                            ["prompt", "generated"])]
    config = output_dir / "config.yaml"
    if config.exists():
        parts += ["<h2>Recipe</h2>", f"<pre>{html.escape(config.read_text())}</pre>"]
    body = "\n".join(parts)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(output_dir.name)}</title>"
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def _examples_section(records: List[dict]) -> List[str]:
    """The examples training records hold (online RL: a prompt's sampled completions with their rewards) at up to
    ``EXAMPLE_STEPS`` logged steps: the first, the last and evenly between; a step's prompt is shown once."""
    logged = [r for r in records if r.get("examples")]
    if not logged:
        return []
    last = len(logged) - 1
    picks = sorted({round(i * last / (EXAMPLE_STEPS - 1)) for i in range(EXAMPLE_STEPS)})
    header = list(logged[0]["examples"][0])
    rows = []
    for record in (logged[i] for i in picks):
        prompt = None
        for example in record["examples"]:
            rows.append([record["step"] if prompt is None else "", *("" if k == "prompt" and example[k] == prompt
                                                                     else example.get(k) for k in header)])
            prompt = example.get("prompt")
    return ["<h2>Examples from training</h2>", _table(rows, ["step", *header])]


def _harness_section(summary: Optional[dict], images: list) -> List[str]:
    """The latest lm-evaluation-harness figures, one row per task, and their curve where it ran more than once."""
    result = (summary or {}).get("harness")
    if not result:
        return []
    metrics = list(dict.fromkeys(m for figures in result["tasks"].values() for m in figures))
    rows = [(task, *[figures.get(m, "") for m in metrics]) for task, figures in result["tasks"].items()]
    parts = ["<h2>lm-evaluation-harness</h2>",
             f"<p>at step {result['step']}, {result['seconds']:.1f} s; num_fewshot {_fmt(result['num_fewshot'])}, "
             f"limit {_fmt(result['limit'])}, lm-eval {html.escape(str(result['lm_eval']))}</p>",
             _table(rows, ["task", *metrics])]
    parts += [f"<img src='{PLOTS}/{path.name}' alt='harness'>" for name, path in images if name == "harness"]
    return parts


# ---------------------------------------------------------------- comparing runs


def run_names(runs: Sequence[Path]) -> List[str]:
    """Short labels for run folders: their names, with their parents where two names are alike."""
    labels = [p.name for p in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{p.parent.name}/{p.name}" for p in runs]
    return labels


def differing_keys(runs: Sequence[Path]) -> Dict[str, List[object]]:
    """Recipe key -> each run's value, for the keys whose values are not all equal (a key a recipe lacks counts
    as missing)."""
    from omegaconf import OmegaConf

    recipes = [flatten(OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))) for run in runs]
    keys = sorted({k for r in recipes for k in r})
    missing = "(not set)"
    return {k: [r.get(k, missing) for r in recipes] for k in keys
            if len({json.dumps(r.get(k, missing), sort_keys=True, default=str) for r in recipes}) > 1}


def compare(runs: Sequence[Path], out: Path) -> str:
    """Write ``out/compare.html`` and ``out/compare.png`` for the runs; returns the comparison as text."""
    names = run_names(runs)
    differing = differing_keys(runs)
    figures = [final_figures(run) for run in runs]
    figure_keys = list(dict.fromkeys(k for f in figures for k in f))
    out.mkdir(parents=True, exist_ok=True)
    png = plots.curves({name: read_records(run) for name, run in zip(names, runs)}, out / "compare.png")
    key_rows = [(k, *values) for k, values in differing.items()]
    figure_rows = [(k, *[f.get(k, "") for f in figures]) for k in figure_keys]
    parts = [f"<h1>{len(runs)} runs compared</h1>",
             _table([(name, str(run)) for name, run in zip(names, runs)], ["run", "folder"]),
             "<h2>Recipe keys that differ</h2>", _table(key_rows, ["key", *names]),
             "<h2>Final figures</h2>", _table(figure_rows, ["figure", *names])]
    if png:
        parts += ["<h2>Curves</h2>", f"<img src='{png.name}' alt='curves'>"]
    write_text(out / "compare.html", "<!doctype html><html><head><meta charset='utf-8'><title>comparison</title>"
               f"<style>{STYLE}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")

    def text_table(title: str, rows: List[tuple]) -> List[str]:
        cells = [[title, *names]] + [[_fmt(v) for v in row] for row in rows]
        widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(len(cells[0]))]
        return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]

    return "\n".join(text_table("recipe key", key_rows or [("(none differ)",)]) + [""]
                     + text_table("figure", figure_rows))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework.report",
                                     description="Write a run's report again, or compare several runs.")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="a run's output_dir")
    parser.add_argument("--out", type=Path, help="where a comparison goes (default runs/compare-<time>)")
    args = parser.parse_args(argv)
    for run in args.runs:
        if not (run / "config.yaml").is_file():
            print(f"error: {run} is not a run's output_dir (it has no config.yaml); pass the output_dir of a run",
                  file=sys.stderr)
            return 2
    out = args.out or Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if len(args.runs) > 1 and (out / "compare.html").exists():
        print(f"error: {out} already holds a comparison; pass another --out", file=sys.stderr)
        return 2
    try:
        if len(args.runs) == 1:
            print(f"wrote {write_report(args.runs[0])}")
            return 0
        print(compare(args.runs, out))
    except WriteFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 5
    print(f"\nwrote {out / 'compare.html'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
