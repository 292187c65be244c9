"""Train with Ray Train's workers: ``python launch/ray_train.py [--address ADDR] [--num_workers N]
[--cpus_per_worker C] [--use_gpu] [--max_failures K] [--config RECIPE] [KEY=VALUE ...]`` (``pip install '.[ray]'``).

The recipe and overrides are recipes/run.py's; framework/ray_launch.py says what each flag does."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from framework.ray_launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_recipe=ROOT / "recipes" / "text_classification.yaml"))
