"""What makes the forward passes cheap: the fused selective log-softmax, logits computed only where a token is
predicted, preallocated (and compiled) KV caches for sampling, and what a model's attention is (its implementation,
its sliding windows).
"""

import inspect
from typing import Callable, Optional

import torch

from .distributed import unwrapped

__all__ = [  # what this module gives as plumbing.NAME (rloo.py, rloo_multinode.py, the tools, the tests)
    "choose_kernels", "preallocated_cache", "StaticDecoder", "accepts_logits_to_keep", "logits_at",
    "attention_implementation", "attention_windows", "SelectiveLogSoftmax",
]


def choose_kernels() -> None:
    """TF32 matmuls, and no cuDNN attention: it builds an execution plan for every new sequence length, and a
    batch's padded length changes with its prompts (measured on an H100, pythia-1b shape, TL;DR-like lengths: the
    same work took 2.1-7.0 s per update with it, 2.0-2.2 s without). SDPA's flash and memory-efficient kernels
    take its place."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(False)


def cast_to_one_dtype(update: Callable) -> Callable:
    """A static cache layer holds keys and values in one dtype, but under bf16 autocast the rotated keys arrive in
    fp32 and the values in bf16: store both in the wider one (the attention casts them as it did before)."""

    def cast_then_update(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        dtype = torch.promote_types(key_states.dtype, value_states.dtype)
        return update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

    return cast_then_update


def preallocated_cache(config, max_length: int, prefilled=None, cache=None):
    """A KV cache of max_length positions per layer (a new one, or `cache` emptied) holding the prefilled keys and
    values (positions 0..Tq-1): decoding writes one position per step in place. A cache grown by concatenation
    instead copies every layer's whole cache at every step, most of a decoding step's memory traffic."""
    from transformers import StaticCache

    if cache is None:
        cache = StaticCache(config=config, max_cache_len=max_length)
        for layer in cache.layers:
            layer.update = cast_to_one_dtype(layer.update)
    elif cache.is_initialized:
        cache.reset()
    for layer, (keys, values, *_) in enumerate(prefilled or ()):
        cache.update(keys, values, layer)
    return cache


class StaticDecoder:
    """What --compile_generation decodes with: one preallocated KV cache of max_length positions per batch size, kept
    and reset between calls (CUDA graphs replay on fixed addresses), and the decoding step, compiled. Every batch
    decodes in max_length positions whatever its prompt width, so the step has one shape per batch size and
    compiles once."""

    def __init__(self, model, max_length: int, backend: str = "inductor"):
        self.model, self.max_length, self.caches = model, max_length, {}
        cuda_graphs = backend == "inductor" and next(model.parameters()).device.type == "cuda"
        self.step = torch.compile(model, backend=backend, dynamic=False,
                                  mode="reduce-overhead" if cuda_graphs else None)

    def cache_holding(self, prefilled, batch_size: int):
        """This batch size's cache, emptied, then holding the prefilled keys and values."""
        self.caches[batch_size] = preallocated_cache(self.model.config, self.max_length, prefilled,
                                                     self.caches.get(batch_size))
        return self.caches[batch_size]


def accepts_logits_to_keep(model) -> bool:
    """Whether the model's forward can compute the logits of chosen positions only (transformers' models can;
    remote code may not)."""
    module = unwrapped(model)
    return "logits_to_keep" in inspect.signature(module.forward).parameters


def logits_at(model, positions: torch.Tensor, **inputs) -> torch.Tensor:
    """(rows, len(positions), V): the logits of those positions only, by one forward pass. The LM head's output is
    the largest activation of a forward pass (V ~ 50k columns per position) and a prompt's positions need none."""
    if accepts_logits_to_keep(model):
        return model(**inputs, logits_to_keep=positions, use_cache=False).logits
    return model(**inputs, use_cache=False).logits[:, positions]  # a model without the argument computes them all


def attention_implementation(model) -> Optional[str]:
    """transformers' name of the model's attention ("sdpa", "eager", "flash_attention_2", ...); None if unknown."""
    module = unwrapped(model)
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def attention_windows(model) -> Optional[dict]:
    """The sliding window (None: none) of each type of layer, as the model's forward takes one 4D mask per type in
    `config.layer_types` ({"full_attention": None, "sliding_attention": 128}), or {None: window} where one mask serves
    every layer (Mistral: `config.sliding_window` or None); None where some layer is not attention (state-space,
    recurrent, linear attention: its state reads the whole row in order, so no mask can keep responses apart)."""
    config = unwrapped(model).config
    types = getattr(config, "layer_types", None)
    if types is None:
        return {None: getattr(config, "sliding_window", None)}
    if not set(types) <= {"full_attention", "sliding_attention"}:
        return None
    return {kind: config.sliding_window if kind == "sliding_attention" else None for kind in set(types)}


class SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(logits / T)[target] and, if asked, the entropy of softmax(logits / T), both differentiable, in a
    few passes over the (N, Tr, V) logits: one exp whose result, normalized in place, is all the backward pass keeps.
    The obvious `log_softmax(logits / T).gather(...)` keeps logits / T and the log-probs, and its backward makes
    several more (N, Tr, V) tensors: at V = 50k this is most of a small model's training step. An entropy that a loss
    uses costs one more (N, Tr, V) fp32 buffer while the backward runs; one that no loss uses costs nothing there."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
        ctx.set_materialize_grads(False)  # an output that no loss uses gets None: its backward term is skipped
        x = logits.float()  # (N, Tr, V); the same tensor when already fp32, never written to
        top = x.max(-1, keepdim=True).values  # (N, Tr, 1)
        probs = (x - top).div_(temperature).exp_()  # (N, Tr, V) unnormalized: the one new (N, Tr, V) tensor
        total = probs.sum(-1, keepdim=True)  # (N, Tr, 1)
        log_total = top / temperature + total.log()  # (N, Tr, 1) logsumexp(x / T)
        logprobs = (x.gather(-1, targets.unsqueeze(-1)) / temperature - log_total).squeeze(-1)  # (N, Tr)
        entropy = None
        if with_entropy or ctx.needs_input_grad[0]:
            probs.div_(total)  # softmax
        if with_entropy:  # logsumexp - E_p[x / T], the expectation as a batched dot product
            expected = torch.matmul(probs.unsqueeze(-2), x.unsqueeze(-1)).reshape(logprobs.shape) / temperature
            entropy = log_total.squeeze(-1) - expected  # (N, Tr)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(probs, targets, entropy)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        probs, targets, entropy = ctx.saved_tensors  # the graph is used once, so the saved buffer becomes the gradient
        g = None if grad_logprobs is None else (grad_logprobs / ctx.temperature).unsqueeze(-1)  # (N, Tr, 1)
        if grad_entropy is None:
            grad = probs.mul_(-g)
        else:  # d entropy / d logits = -softmax (log softmax + entropy) / T
            h = (grad_entropy / ctx.temperature).unsqueeze(-1)  # (N, Tr, 1)
            p_log_p = torch.xlogy(probs, probs)  # (N, Tr, V): the buffer an entropy in the loss costs
            scale = h * entropy.unsqueeze(-1) + (0.0 if g is None else g)  # (N, Tr, 1)
            grad = probs.mul_(-scale).sub_(p_log_p.mul_(h))
        if g is not None:  # (onehot(target) - softmax) g / T
            grad.scatter_add_(-1, targets.unsqueeze(-1), g)
        return grad.to(ctx.dtype), None, None, None
