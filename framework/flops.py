"""Model FLOPs, for MFU (model FLOPs utilization: the FLOPs the model's arithmetic needs per second, over what
the devices can do at most; the hardware's peak is the backend's, ``framework/backend/hardware.py``).

Model FLOPs per token follow PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B), the formula torchtitan's ``get_num_flop_per_token`` and llm-foundry's MFU use:

    6 * N  +  12 * L * H * Q * T

N: the parameters every token's matrix products touch (all but the embedding lookups; an output layer that
shares the embedding matrix is a product, so it counts), L layers, H attention heads of Q dimensions, T the
sequence length. 6N is the forward pass (2N: a multiply and an add per weight) and the backward pass (4N:
gradients of the inputs and of the weights); 12*L*H*Q*T is attention's two products (scores, values) per layer,
forward and backward, at full (not causal) cost, as in PaLM. A frozen weight (adapters, QLoRA) gets no weight
gradient, so it counts 4 instead of 6. Recomputation (gradient checkpointing) and padding are not model FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.memory import parameter_count


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs to train on one token: ``per_token + per_token_context * T`` at sequence length T."""

    per_token: float  # the 6N (4N for frozen weights) part
    per_token_context: float  # 12 * L * H * Q: the attention part, per token of context
    matmul_parameters: int  # N

    def at(self, seq_length: int) -> float:
        return self.per_token + self.per_token_context * seq_length

    def total(self, tokens: int, token_context: int) -> float:
        """FLOPs of training on ``tokens`` tokens whose sequence lengths sum to ``token_context`` over the
        tokens (each token counts the length of the row it is in)."""
        return self.per_token * tokens + self.per_token_context * token_context


def model_flops(model: torch.nn.Module) -> ModelFlops:
    """The model's training FLOPs per token (module docstring), from its parameters and its config's layers,
    heads and head size. Call it on the model as loaded, before ``accelerator.prepare`` shards it."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # peft's wrapper of trainable token rows (adapters.py): its weight is computed, its base layer holds the matrix.
    output = getattr(getattr(output, "token_adapter", None), "base_layer", output)
    tied_output = getattr(output, "weight", None)
    per_token, n = 0.0, 0
    for p in model.parameters():  # shared tensors come once
        if id(p) in embeddings and p is not tied_output:
            continue
        count = parameter_count(p)
        n += count
        per_token += (6 if p.requires_grad else 4) * count
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    context = 12 * layers * heads * head_dim if layers and heads and head_dim else 0
    return ModelFlops(per_token, context, n)
