"""Entry point: ``accelerate launch recipes/run.py [--config RECIPE] [KEY=VALUE ...]``.

``main()`` stays importable because the TPU launcher calls it in each process. That launcher ignores what
``main()`` returns, so a failure leaves as ``SystemExit`` with the status instead of a return value.
"""

import faulthandler
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from framework.cli import main as cli_main  # noqa: E402

DEFAULT_RECIPE = Path(__file__).resolve().parent / "text_classification.yaml"


def main(argv=None) -> int:
    status = cli_main(argv, default_recipe=DEFAULT_RECIPE)
    if status:
        raise SystemExit(status)
    return status


if __name__ == "__main__":
    # A crash in native code (a segfault, glibc's abort on a corrupted heap) prints every thread's Python stack
    # before the process dies: the line of the framework, torch or gloo it happened under.
    faulthandler.enable()
    sys.exit(main())
