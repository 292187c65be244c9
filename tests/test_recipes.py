"""Every shipped recipe, found recursively under recipes/, passes `--dry-run` (validated, data and model
loaded, the plan printed, exit 0) where its hardware is, and is refused (exit 2, naming what is missing)
where it is not. Recipes run from the repository root, as the README shows them."""

import importlib.util
from functools import cache
from pathlib import Path

import pytest
import torch

from helpers import ROOT
from framework.config import loading
from framework.recipe import load_config
from framework.errors import UserError
from in_process import run_main

RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
HAS_CUDA = torch.cuda.is_available()
HAS_XLA = importlib.util.find_spec("torch_xla") is not None


@cache  # the lists below ask it of each recipe several times while the module is collected
def needs(recipe: Path) -> str:
    """The hardware a recipe asks for: 'xla', 'cuda', or '' (whatever this machine has; also for a recipe
    that does not validate, so that its dry run reports why)."""
    try:
        cfg = load_config(recipe, [])
    except UserError:
        return ""
    if cfg.backend == "xla" or cfg.distributed.strategy == "xla_spmd":
        return "xla"
    if cfg.backend == "gpu" or cfg.distributed.strategy in ("fsdp", "deepspeed") or cfg.precision in ("fp16", "fp8"):
        return "cuda"
    return ""


@cache
def processes(recipe: Path) -> int:
    try:
        return load_config(recipe, []).distributed.num_processes or 1
    except UserError:
        return 1


def name(recipe: Path) -> str:
    return str(recipe.relative_to(ROOT / "recipes"))


def dry_run(recipe: Path, tmp_path: Path) -> list:
    return ["--config", str(recipe), "--dry-run", f"output_dir={tmp_path / 'out'}"]


def dry_run_plan(out: str) -> None:
    assert "plan:" in out and "total_steps:" in out and "effective_batch:" in out, out[-3000:]


def refusal(capsys, monkeypatch, hf_home, tmp_path, recipe, *overrides: str) -> str:
    """The dry run's message after checking that it was refused as a user error (exit 2, no traceback)."""
    monkeypatch.chdir(ROOT)
    assert run_main([*dry_run(recipe, tmp_path), *overrides], hf_home) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err
    return err


def models_read(recipe: Path) -> dict:
    """key -> the models a recipe reads, as it names them (read as written: a model that does not exist yet fails
    its checks): ``model.name_or_path``, and an online-RL section's reward models (``model:PATH``)."""
    data, _ = loading.read(recipe, [])
    found = {"model.name_or_path": [(data.get("model") or {}).get("name_or_path") or ""]}
    for section in ("grpo", "rloo"):
        functions = (data.get(section) or {}).get("reward_functions") or []
        if any(str(f).startswith("model:") for f in functions):
            found[f"{section}.reward_functions"] = [str(f) for f in functions]
    return found


@cache  # earlier_runs asks it of every recipe for every recipe
def saved_model(recipe: Path) -> str:
    """The model/ a shipped recipe's run saves, as another recipe names it (``runs/X/model``)."""
    return f"{loading.read(recipe, [])[0].get('output_dir')}/model"


def earlier_runs(recipe: Path):
    """[(a shipped recipe whose run's model/ this recipe reads (``model.name_or_path: runs/X/model``, or a reward
    function ``model:runs/X/model``), the recipe key that names it)]: empty for a recipe that reads none."""
    found = []
    for key, values in models_read(recipe).items():
        for other in RECIPES:
            model = saved_model(other)
            if other != recipe and any(v in (model, f"model:{model}") for v in values):
                found.append((other, key))
    return found


def pointed_at(recipe: Path, key: str, earlier: Path, folder: Path) -> str:
    """The override of ``key`` that reads ``folder`` instead of the ``earlier`` recipe's run's model/."""
    if key == "model.name_or_path":
        return f"model.name_or_path={folder}"
    functions = [f"model:{folder}" if f == f"model:{saved_model(earlier)}" else f for f in models_read(recipe)[key]]
    return f"{key}=[{','.join(functions)}]"


AFTER_A_RUN = [r for r in RECIPES if not needs(r) and earlier_runs(r)]
ANYWHERE = [r for r in RECIPES if not needs(r) and processes(r) == 1 and r not in AFTER_A_RUN]
SEVERAL_PROCESSES = [r for r in RECIPES if not needs(r) and processes(r) > 1]
ON_CUDA = [r for r in RECIPES if needs(r) == "cuda"]
ON_XLA = [r for r in RECIPES if needs(r) == "xla"]


def test_recipes_exist_and_each_is_tested():
    assert any(p.name == "text_classification.yaml" for p in RECIPES)
    assert {"examples/fsdp.yaml", "examples/deepspeed.yaml"} <= {name(r) for r in ON_CUDA}
    assert "examples/tpu.yaml" in {name(r) for r in ON_XLA}
    assert {"examples/lora_causal_lm.yaml", "examples/grpo_reward_model.yaml"} <= {name(r) for r in AFTER_A_RUN}
    assert sorted(ANYWHERE + AFTER_A_RUN + SEVERAL_PROCESSES + ON_CUDA + ON_XLA) == RECIPES


@pytest.mark.parametrize("recipe", ANYWHERE, ids=name)
def test_recipe_dry_run(capsys, monkeypatch, hf_home, tmp_path, recipe):
    monkeypatch.chdir(ROOT)  # the recipes' data and model paths are relative to the repository root
    assert run_main(dry_run(recipe, tmp_path), hf_home) == 0, capsys.readouterr().err[-3000:]
    dry_run_plan(capsys.readouterr().out)
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.parametrize("recipe", AFTER_A_RUN, ids=name)
def test_recipe_on_an_earlier_runs_model(capsys, monkeypatch, hf_home, tmp_path, recipe):
    """Refused by key, naming the earlier run's model/ that is missing (each of them, the others there); dry-runs
    on the models those runs save (built here from the earlier recipes, untrained)."""
    from framework.tasks import get_task

    overrides = {}
    for earlier, key in earlier_runs(recipe):
        first = load_config(earlier, [])
        model, tokenizer = get_task(first.task).load(first, None, None)
        folder = tmp_path / earlier.stem / "model"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        overrides[earlier, key] = pointed_at(recipe, key, earlier, folder)
    for (earlier, key), override in overrides.items():
        model_dir = saved_model(earlier)
        said = refusal(capsys, monkeypatch, hf_home, tmp_path, recipe, *(o for o in overrides.values() if o != override))
        assert (f"model.name_or_path: folder {model_dir} does not exist" in said if key == "model.name_or_path" else
                f"{key}: 'model:{model_dir}': {model_dir} does not exist" in said), said
    assert run_main([*dry_run(recipe, tmp_path), *overrides.values()], hf_home) == 0
    dry_run_plan(capsys.readouterr().out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", SEVERAL_PROCESSES, ids=name)
def test_recipe_dry_run_with_its_processes(cli, tmp_path, recipe):
    proc = cli(dry_run(recipe, tmp_path), launch="cpu_ddp.yaml",
               launch_args=["--num_processes", str(processes(recipe))])
    dry_run_plan(proc.stdout)
    assert f"num_processes: {processes(recipe)}" in proc.stdout


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA GPU: the dry run itself is tested")
@pytest.mark.parametrize("recipe", ON_CUDA, ids=name)
def test_gpu_recipe_is_refused_without_a_gpu(capsys, monkeypatch, hf_home, tmp_path, recipe):
    err = refusal(capsys, monkeypatch, hf_home, tmp_path, recipe)
    assert any(message in err for message in ("torch sees no CUDA device", "needs CUDA GPUs", "fp16 needs a GPU",
                                                 "fp8 needs an fp8-capable GPU")), err[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("recipe", ON_CUDA, ids=name)
def test_gpu_recipe_dry_run(cli, tmp_path, recipe):
    strategy = load_config(recipe, []).distributed.strategy
    if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    launch = {"fsdp": "fsdp.yaml", "deepspeed": "deepspeed_zero2.yaml"}.get(strategy, "gpu.yaml")
    proc = cli(dry_run(recipe, tmp_path), launch=launch, launch_args=["--num_processes", "1"])
    dry_run_plan(proc.stdout)
    assert "backend: gpu" in proc.stdout


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed: the dry run itself is tested")
@pytest.mark.parametrize("recipe", ON_XLA, ids=name)
def test_xla_recipe_is_refused_without_torch_xla(capsys, monkeypatch, hf_home, tmp_path, recipe):
    assert "needs torch_xla" in refusal(capsys, monkeypatch, hf_home, tmp_path, recipe)


@pytest.mark.xla
@pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed: run `make test-xla`")
@pytest.mark.parametrize("recipe", ON_XLA, ids=name)
def test_xla_recipe_dry_run(cli, monkeypatch, tmp_path, recipe):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    proc = cli(dry_run(recipe, tmp_path))
    dry_run_plan(proc.stdout)
    assert "backend: xla" in proc.stdout
