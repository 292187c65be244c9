"""``accelerate launch`` as the launch scripts run it (launch/slurm.sbatch): ``python -m framework.launcher ARGS``
is ``accelerate launch ARGS``, except that a signal stopping torchrun's agent ends it with one line and the
signal's status (128 + its number) instead of the agent's ``SignalException`` traceback. Slurm's TERM at a
preemption reaches every process of the step, the agent too; the workers' own lines (the checkpoint they saved,
"preempted: ...") say what happened."""

from __future__ import annotations

import sys

from accelerate.commands.accelerate_cli import main as accelerate
from torch.distributed.elastic.multiprocessing.api import SignalException


def main() -> int:
    sys.argv = ["accelerate", "launch", *sys.argv[1:]]
    try:
        accelerate()
    except SignalException as stopped:
        print(f"launch: torchrun's agent stopped by {stopped.sigval.name} (its workers' lines say what they did)",
              file=sys.stderr)
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
