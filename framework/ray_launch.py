"""Ray launcher: ``python launch/ray_train.py [--address ADDR] [--num_workers N] ... [--config RECIPE] [KEY=VALUE ...]``.

The same recipe and overrides as ``recipes/run.py``, run by Ray Train's ``TorchTrainer``: each of its workers (a
Ray actor; Ray starts the gloo or NCCL process group and exports RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE,
as torchrun does) runs ``framework.cli.main`` in the driver's working directory. Everything the run writes is the
framework's own: ``output_dir``, its checkpoints and ``model/``, so a run started under ``accelerate launch`` or
torchrun resumes under Ray and the other way round. Ray keeps only its own bookkeeping (``--storage_path``).

The recipe is loaded and checked on the driver before Ray starts, so a bad recipe or key exits 2 at once; the exit
status is the workers' (rank 0's): 0 done, 2 bad input found on the workers (data, model), 3 stopped with a
checkpoint, 4 diverged, 5 an output could not be written; 1 when a worker died (after ``--max_failures`` restarts,
each of which resumes from the last checkpoint).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import List, Optional

from framework.cli import EXIT_USER_ERROR, parse_args
from framework.cli import main as cli_main
from framework.recipe import load_config
from framework.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(f"{message}; usage: {self.format_usage().strip().removeprefix('usage: ')}")


def _launcher_args(argv: List[str]):
    """The launcher's own flags; the rest is the recipe's command line."""
    parser = _Parser(prog="ray_train.py", description=__doc__.split("\n\n")[1])
    parser.add_argument("--address", default=None,
                        help="the Ray cluster to join (auto: the one `ray start` runs here; ray://HOST:10001 ...); "
                             "default: start a local cluster for this run")
    parser.add_argument("--num_workers", type=int, default=2, help="training processes (default 2)")
    parser.add_argument("--cpus_per_worker", type=float, default=1, help="CPUs Ray reserves for each (default 1)")
    parser.add_argument("--use_gpu", action="store_true", help="one GPU a worker (NCCL); default CPU workers (gloo)")
    parser.add_argument("--max_failures", type=int, default=0,
                        help="restarts of the worker group after a worker or node dies; each resumes from the last "
                             "checkpoint (default 0)")
    parser.add_argument("--storage_path", default=None,
                        help="where Ray keeps its run records (default Ray's, ~/ray_results); not the checkpoints")
    ours, recipe_argv = parser.parse_known_args(argv)
    if ours.num_workers < 1:
        raise UserError(f"--num_workers: {ours.num_workers} is not a number of workers; pass 1 or more")
    if ours.max_failures < 0:
        raise UserError(f"--max_failures: {ours.max_failures} is negative; pass 0 (no restart) or more")
    return ours, recipe_argv


def _worker(config: dict) -> int:
    """One training process inside a Ray Train worker: the framework's CLI in the driver's directory. Its exit
    status is what it returns (the driver gets rank 0's)."""
    os.chdir(config["cwd"])  # Ray Train starts its workers in its own run folder; recipe paths are the driver's
    return cli_main(config["argv"], default_recipe=Path(config["default_recipe"]))


def main(argv: Optional[List[str]] = None, default_recipe: Optional[Path] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        ours, recipe_argv = _launcher_args(argv)
        recipe = parse_args(recipe_argv)
        if recipe.print_config or recipe.help_keys is not None:  # nothing to train: answered here
            return cli_main(recipe_argv, default_recipe=default_recipe)
        load_config(recipe.config or default_recipe, recipe.overrides)  # a bad recipe or key: exit 2 before Ray
        try:
            import ray
            from ray.train import FailureConfig, RunConfig, ScalingConfig
            from ray.train.torch import TorchConfig, TorchTrainer
        except ImportError:
            raise UserError("the Ray launcher needs Ray Train: pip install '.[ray]'") from None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR

    root = str(Path(__file__).resolve().parent.parent)
    local = ours.address is None
    try:
        ray.init(address=ours.address, include_dashboard=False,
                 num_cpus=math.ceil(ours.num_workers * ours.cpus_per_worker) if local else None,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                     p for p in (root, os.environ.get("PYTHONPATH")) if p)}})
    except ConnectionError as e:  # no cluster at --address
        print(f"error: --address {ours.address}: {e} Start one with `ray start --head`, or leave --address out to "
              "start a local cluster for this run", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"argv": recipe_argv, "cwd": os.getcwd(), "default_recipe": str(default_recipe)},
        scaling_config=ScalingConfig(num_workers=ours.num_workers, use_gpu=ours.use_gpu,
                                     resources_per_worker={"CPU": ours.cpus_per_worker}),
        torch_config=TorchConfig(backend="nccl" if ours.use_gpu else "gloo"),
        run_config=RunConfig(storage_path=ours.storage_path, failure_config=FailureConfig(max_failures=ours.max_failures)),
    )
    try:
        result = trainer.fit()
    except Exception as e:  # a worker died (or raised) past --max_failures: Ray's error says which and why
        print(f"error: the Ray run failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()
    return 1 if result.return_value is None else int(result.return_value)
