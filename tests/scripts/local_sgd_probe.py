"""Runs the real CLI under `accelerate launch`, recording every Local SGD parameter sync.

For each sync, each process writes the optimizer step it happened at and a checksum of its parameters
just before and just after averaging, to <output_dir>/local_sgd_rank<R>.json.
"""

import json
import os
import sys
from pathlib import Path

from accelerate.local_sgd import LocalSGD

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from framework.cli import main  # noqa: E402

records = []
average = LocalSGD._sync_and_avg_model_params


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def recording_average(self):
    before = checksum(self.model)
    average(self)
    records.append({"step": self.num_steps, "before": before, "after": checksum(self.model)})


LocalSGD._sync_and_avg_model_params = recording_average

if __name__ == "__main__":
    status = main(sys.argv[1:])
    output_dir = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("output_dir="))
    rank = int(os.environ.get("RANK", 0))  # set by the launcher; the process group is gone by now
    Path(output_dir, f"local_sgd_rank{rank}.json").write_text(json.dumps(records))
    sys.exit(status)
