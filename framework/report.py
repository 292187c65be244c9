"""What the run tells the user: the progress bar, metrics.jsonl, trackers, and summary.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

from accelerate import Accelerator
from tqdm.auto import tqdm


def write_text(path: Path, text: str) -> None:
    """Write to a temporary name, then rename: a reader (or a run stopped mid-write) never sees half a file."""
    tmp = path.with_name(f".tmp_{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, obj: Dict) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


class Reporter:
    """Logs from the main process only; every other process holds a silent one."""

    def __init__(self, accelerator: Accelerator, output_dir: Path, total_steps: int, initial_step: int = 0):
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.metrics_path = output_dir / "metrics.jsonl"
        self.bar = tqdm(total=total_steps, initial=initial_step, disable=not self.main, desc="train",
                        unit="step", dynamic_ncols=True)

    def step(self) -> None:
        self.bar.update(1)

    def log(self, record: Dict) -> None:
        """One line of metrics.jsonl (every record has ``step``), mirrored to the trackers."""
        if not self.main:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        self.accelerator.log(numbers, step=record["step"])
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
        self.bar.write(shown)

    def show_loss(self, loss: float, samples_per_second: float) -> None:
        self.bar.set_description_str(f"train loss {loss:.4f}", refresh=False)
        self.bar.set_postfix_str(f"{samples_per_second:.1f} samples/s", refresh=False)

    def print(self, text: str) -> None:
        if self.main:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
