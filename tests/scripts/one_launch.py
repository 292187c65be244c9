"""Several runs of the real CLI one after another in the processes of one ``accelerate launch``: for tests that need
many launched runs of one launch config (starting the processes of a launch costs about 10 s here, a tiny run about
1 s). The argument: a JSON file listing the runs, each ``{"args": [...], "log": PATH}``; each process writes
``PATH.rank{R}.json`` with the run's exit status, stdout and stderr (a traceback, where the run raised). The
run's stdout ends with one JSON line of what it left alive in the process: the class names of the parameters,
optimizers and DeepSpeed runtime objects still reachable, and whether Python's automatic garbage collection is on
(DeepSpeed's ``disable_python_gc`` turns it off while an engine lives); backend.release frees them.

The process group the first run makes is kept for the next ones: accelerate's end of training destroys it, and a
second group made on the same rendezvous hangs. Each run otherwise starts as in a process of its own
(tests/in_process.py's ``fresh_process``)."""

import gc
import io
import json
import os
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from in_process import run_main  # noqa: E402


def left_alive() -> list:
    return sorted({type(o).__name__ for o in gc.get_objects()
                   if isinstance(o, (torch.nn.Parameter, torch.optim.Optimizer))
                   or type(o).__name__ in ("DeepSpeedEngine", "Init", "PartitionedParameterCoordinator")})


def run_all(spec: Path) -> None:
    rank = os.environ["RANK"]
    destroy = PartialState.destroy_process_group
    PartialState.destroy_process_group = lambda self, group=None: None  # kept for the next run
    try:
        for run in json.loads(spec.read_text()):
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                try:
                    status = run_main(run["args"], Path(os.environ["HF_HOME"]))
                except BaseException:  # noqa: BLE001  (SystemExit and all: the record says what the process would)
                    traceback.print_exc()
                    status = 1
                print(json.dumps({"left": left_alive(), "gc_enabled": gc.isenabled()}))
            Path(f"{run['log']}.rank{rank}.json").write_text(
                json.dumps({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}))
    finally:
        PartialState.destroy_process_group = destroy
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_all(Path(sys.argv[1]))
