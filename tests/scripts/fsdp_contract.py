"""What framework/backend/build.py's fsdp2_on_cpu_processes relies on in the installed accelerate, checked on 2 CPU
processes (launched by tests/test_fsdp.py): each assumption that breaks stops here with the reason.

1. accelerate still drops the FSDP plugin on CPU processes (MULTI_CPU): otherwise the switch is no longer
   needed and should go.
2. After the switch, ``prepare`` goes through accelerate's FSDP2 path: a ``FSDPModule`` whose parameters are
   DTensors sharded on dimension 0 over a CPU mesh of all processes, the optimizer over those very parameters.
3. A step runs (FSDP2's all-gather and reduce-scatter over gloo) and its gradients are shards too.
4. ``save_state``/``load_state`` with SHARDED_STATE_DICT write torch.distributed.checkpoint shards of the model
   and the optimizer, and read them back to the same local shards.
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from framework import backend

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="no_wrap",
                                            state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    n = accelerator.num_processes
    assert n == 2, n
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, (
        f"accelerate now sets up {accelerator.distributed_type} itself on CPU processes with an FSDP plugin: "
        "backend.fsdp2_on_cpu_processes is no longer needed; remove it")
    assert getattr(accelerator.state, "fsdp_plugin", None) is None, "accelerate now keeps the plugin on MULTI_CPU"
    assert backend.fsdp2_on_cpu_processes(accelerator, plugin)
    assert accelerator.is_fsdp2 and accelerator.state.fsdp_plugin is plugin
    from accelerate.state import PartialState

    assert PartialState().distributed_type == DistributedType.FSDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, FSDPModule), type(model)
    params = list(model.parameters())
    for p in params:
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), (type(p), getattr(p, "placements", None))
        assert p.device_mesh.device_type == "cpu" and p.device_mesh.size() == n
        assert p.to_local().shape[0] == -(-p.shape[0] // n) or accelerator.process_index > 0
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in params], \
        "the optimizer does not hold the sharded parameters"

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(x).square().mean())
    assert all(isinstance(p.grad, DTensor) for p in params)
    optimizer.step()
    before = [p.to_local().clone() for p in params]

    folder = Path(tempfile.gettempdir()) / f"fsdp_contract_{sys.argv[1]}"
    accelerator.save_state(str(folder))
    names = {p.name for p in folder.iterdir()}
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= names, names
    assert any(p.suffix == ".distcp" for p in (folder / "pytorch_model_fsdp_0").iterdir())
    with torch.no_grad():
        for p in params:
            p.to_local().zero_()
    accelerator.load_state(str(folder))
    for p, saved in zip(model.parameters(), before):
        assert torch.equal(p.to_local(), saved)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print("fsdp2 contract holds")
    accelerator.end_training()


if __name__ == "__main__":
    main()
