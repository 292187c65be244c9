"""The backend's questions and its generation context, on the CPU (tests/test_fsdp.py: the same under FSDP2)."""

from types import SimpleNamespace

from helpers import ROOT

from framework import backend


def accelerator(distributed_type: str, tp_size: int = 1, processes: int = 2) -> SimpleNamespace:
    parallelism = SimpleNamespace(tp_size=tp_size, tp_enabled=tp_size > 1) if tp_size > 1 else None
    return SimpleNamespace(distributed_type=distributed_type, parallelism_config=parallelism,
                           num_processes=processes, process_index=1)


def test_what_the_run_got_is_asked_not_matched_by_name():
    assert backend.shards_parameters(accelerator("FSDP")) and backend.shards_parameters(accelerator("DEEPSPEED"))
    assert not backend.shards_parameters(accelerator("MULTI_CPU"))
    assert backend.on_xla(accelerator("XLA")) and not backend.on_xla(accelerator("MULTI_CPU"))
    tp = accelerator("MULTI_CPU", tp_size=2)
    assert backend.is_tensor_parallel(tp) and not backend.is_tensor_parallel(accelerator("MULTI_CPU"))
    assert backend.data_parallel(tp) == (0, 1) and backend.data_parallel(accelerator("MULTI_CPU")) == (1, 2)


def test_generating_mid_training_leaves_the_weights_bitwise(cli):
    """One process: a generation inside backend.generating between two steps changes no weight, bit for bit."""
    proc = cli(["plain"], script=ROOT / "tests" / "scripts" / "generating_mid_training.py")
    assert "generating mid-training kept the weights (plain)" in proc.stdout
