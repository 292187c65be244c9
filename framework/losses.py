"""Token losses without the logits wall: the output projection and cross-entropy chunk by chunk over tokens.

A language model's largest tensors are its logits (tokens x vocabulary, fp32 for the loss) and their
gradient. Here the model runs without its output head (``hidden_states``: the head's ``forward`` is skipped
for that one call, so every wrapper around the model, DDP's included, runs as usual), and the head is
applied to ``chunk`` tokens at a time:

- ``linear_cross_entropy``: the summed cross-entropy of the target tokens. Each chunk's gradient (with
  respect to the hidden states and the head's trainable weights: a bias, LoRA adapters, tied embeddings)
  is computed in the forward pass, right after its loss, and the chunk's logits are freed: the backward
  pass only scales the stored gradients by the incoming one (a scalar). No chunk is computed twice (Liger
  Kernel's and Apple's Cut Cross-Entropy's order of work, in plain PyTorch), so the head costs the same
  three matrix products as with full logits.
- ``token_logprobs``: per token, the log-probability of its target (summed per row: preference losses; per token:
  online RL); its incoming gradient differs per token, so each chunk is recomputed in the backward pass.
- ``token_outputs``: per token, the loss and whether the argmax is the target (evaluation, no gradient).

Chunks are fixed slices of the flattened tokens, so their shapes depend only on the batch's shape (static
on XLA: no recompilation). ``select=True`` (dynamic shapes: the CPU, CUDA) first keeps only the target tokens,
which skips the head for the others (most tokens of a masked LM). Losses and gradients equal those of the
full logits up to the order of floating-point sums (about 1e-7 relative in fp32).

``output_head(model)``: the head to chunk, or None where the model changes its logits after the head
(soft-capping, scaling) or the architecture is not one checked here; the caller then uses full logits.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

IGNORE = -100  # the target value every loss skips

# Architectures whose logits are the output head's output as it is (no soft-capping or scaling after it),
# each checked against its transformers loss by tests/test_losses.py.
EXACT_MODEL_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "phi3", "bert", "roberta",
                               "distilbert"})


def output_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module that turns the last hidden states into logits (under DDP, FSDP, torch.compile or peft:
    the wrapped model's), or None where chunking it would not be exact."""
    # Imported here: the recipe check imports every task, and accelerate must not be imported before
    # device.select_backend has chosen the backend (with torch_xla installed it would always take XLA).
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model, keep_torch_compile=False)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in EXACT_MODEL_TYPES:
        return None
    head = inner.get_output_embeddings()
    return head if isinstance(head, torch.nn.Module) else None


def hidden_states(model: torch.nn.Module, head: torch.nn.Module, **inputs) -> Tuple[torch.Tensor, bool]:
    """``model(**inputs)`` with ``head`` passing its input through: (the hidden states the head would turn
    into logits, True), or (the model's logits, False) where the model did not call the head module (its
    output has the head's width)."""
    own = head.__dict__.get("forward")  # hooks (accelerate's, peft's) may have set one on the instance
    head.forward = _pass_through  # one function for every call: torch.compile's guards see the same one
    try:
        out = model(**inputs).logits
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    return out, out.shape[-1] != getattr(head, "out_features", None)


def _pass_through(x, *args, **kwargs):
    return x


def _trainable(head: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [p for p in head.parameters() if p.requires_grad]


def _chunks(n: int, chunk: int):
    return [(start, min(start + chunk, n)) for start in range(0, n, chunk)]


def _chunk_logits(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor,
                  grad_weight: Optional[torch.Tensor] = None, argmax: bool = False,
                  entropy_out: Optional[torch.Tensor] = None):
    """One chunk's head output ``z`` and, from it: the loss per token (0 where ignored), the argmax (with
    ``argmax``) and, with ``grad_weight`` (per token), the gradient of sum(grad_weight * loss) with respect to ``z``.
    The fp32 logits are overwritten in place by that gradient: one copy of the chunk's logits at a time.
    ``entropy_out``: filled with each token's entropy of softmax(z) (every token, ignored or not)."""
    z = head(h)
    logits = z.detach().float()  # the very tensor when z is fp32: overwritten below, one copy at a time
    counted = targets != IGNORE
    safe = targets.clamp(min=0)[:, None]
    target = logits.gather(1, safe).squeeze(1)
    top = logits.argmax(dim=1) if argmax else None
    most = logits.amax(dim=1, keepdim=True)
    exp = logits.sub_(most).exp_()  # in place; the log-sum-exp, max-shifted, as logsumexp computes it
    total = exp.sum(dim=1, keepdim=True)
    loss = torch.where(counted, (most + total.log()).squeeze(1) - target, 0.0)
    if entropy_out is not None:  # H = log sum e^x - sum p x, with x the max-shifted logits: log e^x = x
        entropy_out.copy_(total.log().squeeze(1) - torch.special.xlogy(exp, exp).sum(dim=1) / total.squeeze(1))
    if grad_weight is None:
        return z, loss, top, None
    # d loss / d logits = softmax - one-hot(target), times each token's weight (0 where ignored).
    weight = torch.where(counted, grad_weight, 0.0)[:, None]
    grad = exp.mul_(weight / total)
    grad.scatter_add_(1, safe, -weight)
    return z, loss, top, grad.to(z.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum(cross-entropy(head(hidden), targets)); gradients computed in the forward pass, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, targets, head, chunk, *params):
        ones = torch.ones(min(chunk, hidden.shape[0]), dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)

        def chunk_loss(start, end, h):
            z, loss, _, grad_z = _chunk_logits(head, h, targets[start:end], ones[:end - start])
            total.add_(loss.sum())
            return z, grad_z

        grad_hidden, grad_params = _chunked_grads(ctx, hidden, params, chunk, chunk_loss)
        ctx.dtypes = hidden.dtype, [p.dtype for p in params]
        ctx.save_for_backward(*([grad_hidden] if grad_hidden is not None else []), *grad_params)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return _scaled(ctx, list(ctx.saved_tensors), grad_output)


class _TokenLogprobs(torch.autograd.Function):
    """log p(target) per token (0 where ignored), and, with ``entropy``, each token's entropy (not differentiated;
    else an empty tensor); the backward pass recomputes each chunk's logits. (``chunk, entropy`` travel as one
    argument: the Functions' gradients share one layout, hidden, targets, head, chunk, *params.)"""

    @staticmethod
    def forward(ctx, hidden, targets, head, chunk_entropy, *params):
        chunk, with_entropy = chunk_entropy
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(hidden.shape[0] if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for start, end in _chunks(hidden.shape[0], chunk):
            out[start:end] = -_chunk_logits(head, hidden[start:end], targets[start:end],
                                            entropy_out=entropy[start:end] if with_entropy else None)[1]
        ctx.head, ctx.chunk = head, chunk
        ctx.save_for_backward(hidden, targets, *params)
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_output, _grad_entropy):
        hidden, targets, *params = ctx.saved_tensors
        weight = -grad_output.float()  # log p is minus the loss

        def chunk_loss(start, end, h):
            z, _, _, grad_z = _chunk_logits(ctx.head, h, targets[start:end], weight[start:end])
            return z, grad_z

        grad_hidden, grad_params = _chunked_grads(ctx, hidden, params, ctx.chunk, chunk_loss)
        ctx.dtypes = hidden.dtype, [p.dtype for p in params]
        return _scaled(ctx, ([grad_hidden] if grad_hidden is not None else []) + grad_params, None)


def _chunked_grads(ctx, hidden, params, chunk, chunk_loss):
    """Gradients (fp32) of the chunks' losses with respect to ``hidden`` and the wanted ``params``, summed over
    chunks; ``chunk_loss(start, end, h)`` -> (head output, its gradient). One chunk's logits at a time."""
    wants_hidden, wants = ctx.needs_input_grad[0], ctx.needs_input_grad[4:]
    wanted = [p for p, w in zip(params, wants) if w]
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if wants_hidden else None
    grad_params = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in wanted]
    for start, end in _chunks(hidden.shape[0], chunk):
        h = hidden[start:end].detach().requires_grad_(wants_hidden)
        with torch.enable_grad():
            z, grad_z = chunk_loss(start, end, h)
            inputs = ([h] if wants_hidden else []) + wanted
            grads = list(torch.autograd.grad(z, inputs, grad_z, allow_unused=True)) if inputs else []
        if wants_hidden:
            grad_hidden[start:end] = grads.pop(0)
        for acc, g in zip(grad_params, grads):
            if g is not None:
                acc.add_(g)
        del z, grad_z, grads
    return grad_hidden, grad_params


def _scaled(ctx, grads: list, scale: Optional[torch.Tensor]):
    """The Function's input gradients (hidden, targets, head, chunk, *params) from fp32 ``grads`` (the hidden
    states' first if wanted, then the wanted parameters'), times ``scale``, in each input's dtype."""
    hidden_dtype, param_dtypes = ctx.dtypes
    grads = iter(grads)

    def cast(g, dtype):
        return (g if scale is None else g * scale).to(dtype)

    grad_hidden = cast(next(grads), hidden_dtype) if ctx.needs_input_grad[0] else None
    return (grad_hidden, None, None, None,
            *[cast(next(grads), dtype) if w else None for w, dtype in zip(ctx.needs_input_grad[4:], param_dtypes)])


def _flat(hidden: torch.Tensor, targets: torch.Tensor, select: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(tokens, features) hidden states and their targets; with ``select`` only the counted ones, and the mask."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    if not select:
        return hidden, targets, None
    counted = targets != IGNORE
    return hidden[counted], targets[counted], counted


def linear_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk: int,
                         select: bool = False) -> torch.Tensor:
    """The summed cross-entropy (fp32) of ``head(hidden)`` against ``targets`` (``IGNORE`` skipped), never
    holding more than ``chunk`` tokens' logits. ``select``: first drop the ignored tokens (dynamic shapes)."""
    hidden, targets, _ = _flat(hidden, targets, select)
    if hidden.shape[0] == 0:
        return hidden.sum(dtype=torch.float32) * 0.0
    if not torch.is_grad_enabled():
        return sum(_chunk_logits(head, hidden[s:e], targets[s:e])[1].sum() for s, e in _chunks(hidden.shape[0], chunk))
    return _LinearCrossEntropy.apply(hidden, targets, head, chunk, *_trainable(head))


def token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk: int,
                   select: bool = False, with_entropy: bool = False):
    """Per token of ``targets``' shape, the log-probability (fp32) of its target under ``head(hidden)``, 0 where
    ignored, differentiable, never holding more than ``chunk`` tokens' logits (online RL's per-token ratios).
    ``select``: the head runs on the target tokens only (dynamic shapes). ``with_entropy``: (log-probabilities,
    the entropy of each token's distribution, not differentiable, 0 where ignored)."""
    flat_hidden, flat_targets, counted = _flat(hidden, targets, select)
    out, entropy = _TokenLogprobs.apply(flat_hidden, flat_targets, head, (chunk, with_entropy), *_trainable(head))
    values = [out, torch.where(flat_targets != IGNORE, entropy, 0.0)] if with_entropy else [out]
    if counted is not None:
        values = [torch.zeros(counted.shape, dtype=t.dtype, device=t.device).masked_scatter(counted, t) for t in values]
    values = [t.view(targets.shape) for t in values]
    return tuple(values) if with_entropy else values[0]


@torch.no_grad()
def token_outputs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk: int,
                  select: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per token of ``targets``' shape: the cross-entropy (fp32, 0 where ignored) and whether the argmax
    of the logits is the target, chunk by chunk."""
    shape = targets.shape
    flat_hidden, flat_targets, counted = _flat(hidden, targets, select)
    losses = torch.zeros(flat_targets.shape[0], dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(flat_targets.shape[0], dtype=torch.bool, device=hidden.device)
    for start, end in _chunks(flat_hidden.shape[0], chunk):
        t = flat_targets[start:end]
        _, loss, argmax, _ = _chunk_logits(head, flat_hidden[start:end], t, argmax=True)
        losses[start:end], correct[start:end] = loss, (argmax == t) & (t != IGNORE)
    if counted is not None:
        losses = torch.zeros(counted.shape, dtype=torch.float32, device=hidden.device).masked_scatter_(counted, losses)
        correct = torch.zeros(counted.shape, dtype=torch.bool, device=hidden.device).masked_scatter_(counted, correct)
    return losses.view(shape), correct.view(shape)
