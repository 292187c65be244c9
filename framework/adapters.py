"""Adapters through the peft library: LoRA on a frozen pretrained model, and QLoRA (the frozen base linear
layers in 4-bit NF4 through bitsandbytes).

``check`` reports the recipe problems; ``apply`` wraps the loaded model; ``save`` writes ``model/`` (the adapter
in peft's format, and with ``peft.merge`` a plain merged model that ``pipeline()`` loads without peft).
The loop sees an ordinary module whose only trainable parameters are the adapters (and ``modules_to_save``, and
the embedding rows of tokens a built-in chat template added, ``templates.NEW_ROWS``: peft's
``trainable_token_indices``, the output layer's rows too where it is tied; frozen, a new row stays where
``templates.resize_embeddings`` put it, and an adapter alone cannot make the model write a token whose output row
is the mean of others'): the optimizer is built over trainable parameters only, so gradients and optimizer state
exist for them alone.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from framework import backend, hub, templates
from framework.errors import UserError

ADAPTER_DIR = "adapter"  # under model/, when model/ holds the merged model
CONV1D = "_framework_conv1d"  # marks a 4-bit layer that was a transformers Conv1D (its weight transposed)
NO_4BIT_ON_XLA = ("peft.quantize: 4-bit weights need bitsandbytes kernels, which XLA lacks; use LoRA without "
                  "quantize on XLA (peft.quantize=null)")


def check(cfg, strategy: backend.Strategy) -> List[str]:
    """Problems of the ``peft`` section with the rest of the recipe and the run's strategy."""
    p = cfg.peft
    if p is None:
        return []
    problems = []
    if cfg.model.config is not None:
        problems.append("peft: adapters train on top of a pretrained model, but model.config builds a new one; set "
                        "model.name_or_path (e.g. the model/ folder of an earlier run) or remove the peft section")
    fsdp1 = strategy.name == "fsdp" and strategy.fsdp_version == 1
    if strategy.name == "xla_fsdp" or fsdp1:
        name = "fsdp with distributed.fsdp.version 1" if fsdp1 else strategy.name
        problems.append(f"peft: adapters run with one process, DDP, FSDP2 or DeepSpeed (and on XLA with xla_spmd), "
                        f"not with distributed.strategy {name}; use distributed.strategy=fsdp (version 2) or ddp, or "
                        "remove the peft section")
    if p.quantize and strategy.name == "deepspeed":
        problems.append("peft.quantize: 4-bit weights under DeepSpeed are not wired here (QLoRA runs with one "
                        "process, DDP or FSDP2); use distributed.strategy=ddp or fsdp, or peft.quantize=null")
    if p.quantize and cfg.backend == "xla":
        problems.append(NO_4BIT_ON_XLA)
    if hub.is_gguf(cfg.model.name_or_path or "") and not p.merge:
        problems.append("peft.merge: an adapter's base must be a model folder peft can load, and a GGUF file is "
                        "not one; set peft.merge=true (model/ then holds the merged model) or point "
                        "model.name_or_path at a model folder")
    return problems


def apply(model: torch.nn.Module, cfg, device_type: str, task_type: Optional[str]) -> torch.nn.Module:
    """The model with adapters (a ``PeftModel``); unchanged without a ``peft`` section. ``task_type``: peft's
    task type for the model (``Task.peft_task_type``)."""
    p = cfg.peft
    if p is None:
        return model
    from peft import LoraConfig, get_peft_model

    names = [name for name, _ in model.named_modules()]
    for wanted in p.modules_to_save:
        if not any(name == wanted or name.endswith("." + wanted) for name in names):
            raise UserError(f"peft.modules_to_save: '{wanted}' names no module of this model; module names look "
                            f"like {', '.join(repr(n) for n in names[1:4])}")
    if p.quantize:
        if device_type == "xla":  # backend auto on an XLA machine
            raise UserError(NO_4BIT_ON_XLA)
        _quantize_4bit(model, keep=_kept_in_full(model, p.modules_to_save))
    try:
        # GPT-2's layers are Conv1D, whose weight is stored transposed: peft's fan_in_fan_out (else it sets it itself,
        # with a warning on every run).
        conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
        config = LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=p.target_modules,
                            modules_to_save=list(p.modules_to_save) or None, task_type=task_type,
                            fan_in_fan_out=conv1d, trainable_token_indices=_new_rows(model, p.modules_to_save))
        model = get_peft_model(model, config)
    except ValueError as e:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) or type(m).__name__ in ("Conv1D", "Linear4bit")})
        raise UserError(f"peft.target_modules: {str(e).splitlines()[0]} (this model's linear layers: "
                        f"{', '.join(names)})") from None
    # Where the adapter's base comes from, so model/ loads from any working directory.
    name = cfg.model.name_or_path
    if os.path.isdir(name):
        model.peft_config["default"].base_model_name_or_path = str(Path(name).resolve())
    return model


def _new_rows(model: torch.nn.Module, modules_to_save: List[str]) -> Optional[List[int]]:
    """The embedding rows a built-in template's tokens added (``templates.NEW_ROWS``), trained beside the adapters;
    None where there are none, or where ``modules_to_save`` trains the whole embedding already."""
    rows = getattr(model, templates.NEW_ROWS, None)
    embedding = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is embedding), "")
    if not rows or any(name == w or name.endswith("." + w) for w in modules_to_save):
        return None
    return list(rows)


def _kept_in_full(model: torch.nn.Module, modules_to_save: List[str]) -> set:
    """Linear layers QLoRA leaves unquantized: the output layer (logits, as transformers does), the heads a
    task trains in full (classification), and ``modules_to_save``."""
    keep = set(modules_to_save) | {"classifier", "score"}
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name for name, m in model.named_modules()
            if m is out or name.rsplit(".", 1)[-1] in keep or any(name.startswith(k + ".") for k in keep)}


def _quantize_4bit(model: torch.nn.Module, keep: set) -> None:
    """Replace every ``nn.Linear`` and transformers ``Conv1D`` (GPT-2's, a linear layer with its weight
    transposed) except ``keep`` by a bitsandbytes NF4 ``Linear4bit`` holding the same weights quantized (what
    transformers' ``load_in_4bit`` does while loading); computation stays in the weights' own precision. A layer
    that was a ``Conv1D`` is marked (``CONV1D``), so that ``merged`` gives it back its own layout."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError("peft.quantize: 4-bit weights need bitsandbytes, which is not installed; "
                        "`pip install bitsandbytes` or set peft.quantize=null") from None
    from transformers.pytorch_utils import Conv1D

    quantized_any = False
    for name, module in list(model.named_modules()):
        conv1d = isinstance(module, Conv1D)
        if not (isinstance(module, torch.nn.Linear) or conv1d) or name in keep:
            continue
        weight = module.weight.t() if conv1d else module.weight  # Conv1D's is (in, out)
        out_features, in_features = weight.shape
        quantized = bnb.nn.Linear4bit(in_features, out_features, bias=module.bias is not None,
                                      compute_dtype=weight.dtype, quant_type="nf4", device="meta")
        setattr(quantized, CONV1D, conv1d)
        # On a CPU with AVX512-bf16, bitsandbytes (0.50) repacks a layer in place into an inference-only layout
        # at its first forward without gradients (our evaluation), keeps that layout when training resumes,
        # and fails for layers narrower than its 64-value blocks. One layout, the one training reads, on every CPU.
        quantized.support_avx512bf16_for_cpu = False
        quantized.weight = bnb.nn.Params4bit(weight.data.contiguous(), requires_grad=False,
                                             quant_type="nf4").to(weight.device)
        if module.bias is not None:
            quantized.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
        quantized.register_load_state_dict_pre_hook(_check_quantization_state)
        model.set_submodule(name, quantized)
        quantized_any = True
    if not quantized_any:
        raise UserError(f"peft.quantize: {type(model).__name__} has no linear layer to quantize beyond its output "
                        "layer and the ones trained in full; set peft.quantize=null")


def _check_quantization_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
    """A 4-bit layer's load from a checkpoint (a resume): bitsandbytes writes the weight's quantization state
    (``weight.absmax``, ``weight.quant_map``, ...) beside it, and no layer loads it back (unexpected keys). This run
    quantized the same base weights when it started: the state is taken out, after checking it is the one this
    layer holds (else the base weights are not those the checkpoint trained on)."""
    stem, layer = prefix + "weight.", prefix.rstrip(".")
    saved = {key[len(stem):]: state_dict.pop(key) for key in list(state_dict) if key.startswith(stem)}
    weight = state_dict.get(prefix + "weight")
    if not saved:
        if weight is not None and weight.dtype != module.weight.dtype:
            raise UserError(f"resume: the checkpoint's layer {layer} is not 4-bit (a framework before QLoRA "
                            "quantized GPT-2's Conv1D layers wrote it); start a new run (overwrite=true)")
        return
    own = getattr(module.weight, "quant_state", None)
    own = own.as_dict(packed=True) if own is not None else {}
    if saved.keys() != own.keys() or not all(torch.equal(saved[k].cpu(), own[k].cpu()) for k in own):
        raise UserError(f"resume: the checkpoint's 4-bit layer {layer} differs from the one quantized from "
                        "model.name_or_path now (other base weights, or another device or bitsandbytes version "
                        "quantizing them); resume with the model and machine the run started on")


def _fsdp_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _host_copy(model: torch.nn.Module, state_dict: Optional[Dict[str, torch.Tensor]]) -> torch.nn.Module:
    """The adapted model rebuilt on the host, unsharded, holding ``state_dict``: its transformers class (FSDP2
    made the model's class a subclass of it and of FSDPModule) from its config, adapted with its own LoRA config.
    Building draws random initial weights, which ``state_dict`` then replaces: the global RNG (dropout) is put back."""
    from peft import get_peft_model
    from torch.distributed.fsdp import FSDPModule

    if state_dict is None:
        raise ValueError("a model sharded by FSDP2 is copied from its full state dict, which was not given")
    base = model.get_base_model()
    cls = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))
    with torch.random.fork_rng(devices=[]):
        host = get_peft_model(cls(base.config), copy.deepcopy(model.peft_config[model.active_adapter]))
    missing, unexpected = host.load_state_dict(state_dict, strict=False)
    tied = {name for name, p in host.named_parameters(remove_duplicate=False)} - \
        {name for name, p in host.named_parameters()}
    if unexpected or set(missing) - tied:
        raise ValueError(f"the full state dict does not fit the rebuilt model: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    return host


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether peft wrapped the model; without importing peft (2.4 s) when nothing did."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def save(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor], tokenizer, path: Path, merge: bool) -> None:
    """Write the adapter (peft's ``adapter_config.json`` + ``adapter_model.safetensors``) and the tokenizer
    into ``path``; with ``merge``, ``path`` holds the merged model instead and the adapter goes to
    ``path/adapter``. ``state_dict``: the full one on the host (from ``device.state_dict_for_save``)."""
    adapter_path = path / ADAPTER_DIR if merge else path
    # Grown embeddings (a built-in template's tokens) are saved with the adapter, which cannot load on the base's
    # vocabulary otherwise: said here, where peft would decide it itself with a warning on every run.
    model.save_pretrained(adapter_path, state_dict=state_dict,
                          save_embedding_layers=bool(getattr(model, templates.NEW_ROWS, None)))
    tokenizer.save_pretrained(path)
    if merge:
        merged(model, state_dict).save_pretrained(path)


def merged(model: torch.nn.Module, state_dict: Optional[Dict[str, torch.Tensor]] = None) -> torch.nn.Module:
    """A host copy of the adapted model with the adapters added into the base weights: the plain transformers
    model, computing what the adapted one does. 4-bit base layers are dequantized (the weights the adapters
    trained against), not requantized after the merge, which would round the adapters' update away. A model
    sharded by FSDP2 cannot be copied (fully_shard forbids deepcopy): its copy is built from ``state_dict``,
    the full one."""
    model = _host_copy(model, state_dict) if _fsdp_sharded(model) else copy.deepcopy(model).to("cpu")
    replaced = []
    for name, module in list(model.named_modules()):
        base = getattr(module, "base_layer", module)
        if type(base).__name__ != "Linear4bit" or any(name.startswith(r + ".") for r in replaced):
            continue
        replaced.append(name)
        import bitsandbytes.functional as bnb_functional

        weight = bnb_functional.dequantize_4bit(base.weight.data, base.weight.quant_state).to(torch.float32)
        if base is not module:  # an adapted layer: its update added in
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter).to(torch.float32)
        if getattr(base, CONV1D, False):
            from transformers.pytorch_utils import Conv1D

            linear = Conv1D(base.out_features, base.in_features)
            linear.weight.data = weight.t().contiguous()
        else:
            linear = torch.nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
            linear.weight.data = weight
        if base.bias is not None:
            linear.bias.data = base.bias.data.to(torch.float32)
        model.set_submodule(name, linear)
    return model.merge_and_unload()
