"""Runs the real CLI in this process, then prints one JSON line of what the run left alive in it: the class names
of the parameters, optimizers and DeepSpeed runtime objects still reachable, and whether Python's automatic garbage
collection is on (DeepSpeed's ``disable_python_gc`` turns it off while an engine lives). What is left is torn down during the interpreter's shutdown (backend.release)."""

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from run import main  # noqa: E402  (recipes/run.py: the default recipe too)

if __name__ == "__main__":
    status = main(sys.argv[1:])
    import torch

    left = sorted({type(o).__name__ for o in gc.get_objects()
                   if isinstance(o, (torch.nn.Parameter, torch.optim.Optimizer))
                   or type(o).__name__ in ("DeepSpeedEngine", "Init", "PartitionedParameterCoordinator")})
    print(json.dumps({"left": left, "gc_enabled": gc.isenabled()}), flush=True)
    sys.exit(status)
