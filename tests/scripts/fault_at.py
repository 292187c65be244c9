"""Runs the real CLI with the fault FAULT (``KIND@POINT:N``, tests/fault_injection.py) injected: for faults that need
a process of their own (SIGKILL). FAULT_DISK: the small filesystem the run writes on; the run's output_dir comes
from its ``output_dir=`` override. Launched as several processes, FAULT_RANK: the one process that injects it
(by default each)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fault_injection  # noqa: E402
from run import main  # noqa: E402  (recipes/run.py: the default recipe too)

if __name__ == "__main__":
    output_dir = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("output_dir="))
    if os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", os.environ.get("RANK", "0")):
        fault_injection.install(os.environ["FAULT"], Path(os.environ.get("FAULT_DISK", output_dir)), Path(output_dir))
    sys.exit(main(sys.argv[1:]))
