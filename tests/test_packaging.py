"""The package installs as a package: importable from anywhere, not only from the clone's root."""

import os
import subprocess
import sys


def test_framework_imports_outside_the_clone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", "import framework.cli, framework.testing; print(framework.__version__)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0.1.0"
