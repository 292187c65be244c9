"""Launch configs parse; every recipe/launch mismatch is refused with its message. That 2 processes (gloo) train
what one does, for every task, is tests/test_task_contract.py's."""

from types import SimpleNamespace

import pytest
import torch

from helpers import ROOT, tiny_args
from framework.cli import main

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_launch_config_parses_with_accelerate(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(config))
    assert loaded.num_processes >= 1 and loaded.distributed_type is not None


def test_every_target_has_its_config():
    names = {p.name for p in CONFIGS}
    assert names >= {"cpu.yaml", "cpu_ddp.yaml", "gpu.yaml", "multi_gpu.yaml", "multi_node.yaml", "fsdp.yaml",
                     "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "tpu.yaml"}
    readme = (ROOT / "README.md").read_text()
    for name in names:
        assert f"accelerate_configs/{name}" in readme, f"README does not show how to use {name}"


def error_of(capsys, args):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.fixture
def args(tiny_model, easy_data, tmp_path):
    return lambda *extra: tiny_args(tiny_model, easy_data, tmp_path / "out", *extra)


@pytest.mark.skipif(torch.cuda.is_available(), reason="assumes a machine without CUDA")
@pytest.mark.parametrize("override,message", [
    ("distributed.strategy=fsdp distributed.fsdp.version=1", "distributed.fsdp.version: 1 (FlatParameter FSDP) "
                                                             "needs CUDA GPUs"),
    ("distributed.strategy=deepspeed distributed.deepspeed.offload_params=cpu", "distributed.deepspeed."
                                                                               "offload_params: offloading to the host"),
    ("distributed.fsdp.replicas=2", "distributed.fsdp.replicas: HSDP is FSDP2's"),
    ("distributed.strategy=fsdp distributed.fsdp.sharding_strategy=HYBRID_SHARD", "its hybrid sharding is "
                                                                                "distributed.fsdp.replicas"),
    ("backend=gpu", "backend: gpu, but torch sees no CUDA device"),
    ("precision=fp16", "precision: fp16 needs a GPU"),
    ("precision=fp8", "precision: fp8 needs an fp8-capable GPU"),
    ("distributed.num_processes=2", "the recipe expects 2 processes but the launch started 1"),
    # Tensor parallelism (trained for real by tests/test_fsdp.py): what it cannot be combined with, by key.
    ("distributed.tensor_parallel=2", "distributed.tensor_parallel: 2, but the launch started 1 process(es)"),
    ("distributed.tensor_parallel=2 distributed.strategy=fsdp", "2D TP x FSDP2 needs accelerate's FSDP2 x TP preparation"),
    ("distributed.tensor_parallel=2 distributed.local_sgd_steps=2", "local SGD averages whole models"),
    ("distributed.tensor_parallel=2 peft.r=4", "peft's LoRA layers wrap the linear layers"),
])
def test_mismatch_is_refused(capsys, args, override, message):
    assert message in error_of(capsys, args(*override.split()))


@pytest.mark.parametrize("kind, config, message", [
    ("gpt2", dict(n_layer=1, n_head=2, n_embd=8), "GPT2LMHeadModel has no tensor-parallel plan"),
])
def test_tensor_parallel_refuses_a_model_it_cannot_shard(kind, config, message):
    """Checked before transformers shards anything (the 2-process run: tests/test_fsdp.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from framework import backend
    from framework.errors import UserError

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=16, **config))
    accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(tp_size=2, tp_enabled=True))
    with pytest.raises(UserError, match=message):
        backend.tensor_parallel_model(accelerator, model)


def test_xla_without_torch_xla_names_the_extra(capsys, args):
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed in this environment")
    assert "pip install -e '.[xla]'" in error_of(capsys, args("backend=xla"))


def test_fp16_on_xla_is_refused(capsys, args, monkeypatch):
    from framework.backend import selection

    monkeypatch.setattr(selection, "has_xla", lambda: True)
    assert "precision: fp16 is not supported on XLA" in error_of(capsys, args("backend=xla", "precision=fp16"))


def test_launch_with_fsdp_but_recipe_ddp(capsys, args, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert "the launch config sets up fsdp" in error_of(capsys, args("distributed.strategy=ddp"))


def test_strategy_auto_takes_the_recipe_fsdp_settings_under_an_fsdp_launch(monkeypatch):
    from framework import backend
    from framework.config import RunConfig

    cfg = RunConfig()
    f = cfg.distributed.fsdp
    f.sharding_strategy, f.auto_wrap_policy, f.min_num_params, f.offload_params = "SHARD_GRAD_OP", "size", 1234, True
    assert "fsdp_plugin" not in backend.build._plugins(cfg)  # strategy auto, launched without FSDP
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    plugin = backend.build._plugins(cfg)["fsdp_plugin"]
    assert cfg.distributed.strategy == "auto" and backend.strategy(cfg) == "fsdp"
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False  # SHARD_GRAD_OP under FSDP2
    assert plugin.min_num_params == 1234 and plugin.auto_wrap_policy.__name__ == "size_based_auto_wrap_policy"
    assert plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"


def test_the_zero_stage_is_the_recipes_else_the_launch_configs_else_2_and_a_contradiction_is_refused(monkeypatch):
    from framework import backend
    from framework.config import RunConfig
    from framework.errors import UserError

    cfg = RunConfig()
    cfg.train.gradient_accumulation_steps = 4
    assert "deepspeed_plugin" not in backend.build._plugins(cfg)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # strategy auto under a DeepSpeed launch config
    assert backend.build._plugins(cfg)["deepspeed_plugin"].zero_stage == 2  # neither says: 2
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    plugin = backend.build._plugins(cfg)["deepspeed_plugin"]
    assert plugin.zero_stage == 3 and plugin.gradient_accumulation_steps == 4  # the launch config's
    cfg.distributed.deepspeed.zero_stage = 3
    assert backend.build._plugins(cfg)["deepspeed_plugin"].zero_stage == 3
    cfg.distributed.deepspeed.zero_stage = 1
    with pytest.raises(UserError, match="distributed.deepspeed.zero_stage: 1, but the launch config sets ZeRO stage 3"):
        backend.check(cfg)
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    assert backend.build._plugins(cfg)["deepspeed_plugin"].zero_stage == 1  # the recipe's


def test_launch_of_two_processes_set_up_as_one_is_refused(capsys, args, monkeypatch):
    """The old failure: the launcher starts 2 processes but accelerate sets up a single-process run in each
    (here forced by not asking for the CPU), which would train twice into one output_dir."""
    from framework.backend import build

    monkeypatch.setattr(build, "auto_means_cpu", lambda cfg: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    err = error_of(capsys, args())
    assert "backend: the launch started 2 processes (2 on this machine) but accelerate set up 1" in err


def test_multi_cpu_config_that_starts_one_process(cli, args, tmp_path):
    """distributed_type MULTI_CPU with 2 processes starts a single process under accelerate launch."""
    config = tmp_path / "multi_cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 1\n"
                      "num_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    proc = cli(args(), launch=str(config), check=False)
    assert "only one was started" in proc.stderr and "cpu_ddp.yaml" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="assumes a machine without CUDA")
def test_plan_says_when_auto_falls_back_to_cpu(capsys, args):
    assert main(args("--dry-run")) == 0
    out = capsys.readouterr().out
    assert "note: backend auto: no GPU or XLA device found, training on the CPU" in out
    assert "effective_batch: 8" in out and "steps_per_epoch: 45" in out
