"""Measuring: each phase's time and tokens per update, the token-forwards against the minimum, free memory turned into
rows per forward pass, the sampler/trainer mismatch metrics, how far a run's learning rates can move the weights.
"""

import contextlib
import math
import os
import time
from typing import Callable, Optional

import torch

from .distributed import all_reduce, note_phase

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "PhaseTimer", "minimum_forward_tokens", "rows_per_forward", "mismatch_metrics", "sum_over_updates", "movement_note",
    "EvalTotals",
]


class PhaseTimer:
    """Per phase of an update (`with timer("generation"): ...`): wall-clock seconds (CUDA synchronized, so GPU time
    lands in its phase), on CUDA the peak allocated memory in GiB, and the token positions fed through the forward
    passes of the models it watches (count_tokens_of), padding included: the work done, to set against the least
    that would do; and the bytes each decoding step must read (every weight, the whole KV cache), to set against the
    memory bandwidth. One per run; start_update() clears it. Forward passes outside any phase count under
    `default_phase` (None: not counted); a compiled decoding step's (--compile_generation) are not counted."""

    def __init__(self, device: torch.device, default_phase: Optional[str] = None):
        self.device = device
        self.default_phase = default_phase
        self.phase = None
        self.weight_bytes = {}  # id(backbone) -> bytes of the weights a decoding step reads
        self.start_update()

    def start_update(self) -> None:
        self.seconds = {}
        self.peak_gib = {}
        self.tokens = {}
        self.decode_bytes = 0

    def count_tokens_of(self, *models) -> None:
        for model in models:  # the transformer itself, which every use of the model calls once per pass
            backbone = getattr(model, getattr(model, "base_model_prefix", ""), model)
            if model is not None and id(backbone) not in self.weight_bytes:  # once each
                backbone.register_forward_pre_hook(self._count, with_kwargs=True)
                self.weight_bytes[id(backbone)] = decode_weight_bytes(model)

    def _count(self, module, args, kwargs) -> None:
        phase = self.phase or self.default_phase
        if phase is None or torch.compiler.is_compiling():  # a Python side effect would break a compiled graph
            return
        input_ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        self.tokens[phase] = self.tokens.get(phase, 0) + input_ids.numel()
        cache = kwargs.get("past_key_values")
        if input_ids.shape[1] == 1 and cache is not None:  # a decoding step, after a prefill
            self.decode_bytes += self.weight_bytes[id(module)] + sum(
                layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        note_phase(phase)
        start, self.phase = time.perf_counter(), phase
        try:
            yield
        finally:
            self.phase = None
        if cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            self.peak_gib[phase] = max(peak, self.peak_gib.get(phase, 0.0))
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """`time/<phase>` and `work/<phase>_tokens` for every phase, `work/forward_tokens` over all of them; on CUDA
        `memory/<phase>_gib` and `memory/peak_gib` too."""
        out = {f"time/{phase}": seconds for phase, seconds in self.seconds.items()}
        out.update({f"work/{phase}_tokens": float(tokens) for phase, tokens in self.tokens.items()})
        out["work/forward_tokens"] = float(sum(self.tokens.values()))
        if self.decode_bytes:
            out["work/decode_bytes"] = float(self.decode_bytes)
        if self.peak_gib:
            out.update({f"memory/{phase}_gib": gib for phase, gib in self.peak_gib.items()})
            out["memory/peak_gib"] = max(self.peak_gib.values())
        return out


def decode_weight_bytes(model) -> int:
    """Bytes of the weights one decoding step reads: all of them but an untied input embedding, of which a step
    reads one row per sequence."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = head is None or head.weight is not embedding.weight
    return sum(p.nbytes for p in model.parameters() if not (untied and p is embedding.weight))


def minimum_forward_tokens(c, passes: int) -> float:
    """The least token positions `passes` forward passes over the completions could feed: every prompt token once,
    every response token (up to its stop token) once per completion, in each pass."""
    return float(passes * (int(c.query_mask.sum()) + int(c.response_mask.sum())))


def free_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation can take now: free GPU memory plus what PyTorch's allocator holds unused, or the
    available RAM."""
    if device.type == "cuda":
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # cached by torch
        return torch.cuda.mem_get_info(device)[0] + reusable
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def forward_bytes_per_row(config, phase: str, prompt_length: int, response_length: int, dtype_bytes: int,
                          k: int = 1) -> float:
    """Peak bytes one completion adds to a no-grad forward pass of this phase, its prompt shared with k-1 others
    (a prompt group is one forward row of prompt_length + k * response_length tokens): one layer's transient
    activations (about 4 x hidden + intermediate values per token) and, when sampling, its KV cache of every layer
    (the prompt's once, read by its k rows) and one step's fp32 logits; for log-probs, the response's fp32 logits
    and softmax; with k > 1, its share of the group's attention mask and per-head scores."""
    hidden, tokens = config.hidden_size, prompt_length / k + response_length
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_row = (4 * hidden + intermediate) * tokens * dtype_bytes
    if phase == "generation":
        per_row += 2 * config.num_hidden_layers * hidden * (prompt_length + response_length) * dtype_bytes \
            + 3 * config.vocab_size * 4
    elif phase == "logprobs":
        per_row += 2 * response_length * config.vocab_size * 4
    if k > 1 and phase != "generation":
        row_length = prompt_length + k * response_length
        per_row += row_length**2 * (1 + config.num_attention_heads * dtype_bytes) / k
    return per_row


def rows_per_forward(args, model, phase: str, device: torch.device, rows: int, k: int = 1) -> int:
    """local_rollout_forward_batch_size completions, or with 0 the most of `rows` whose forward through `model`
    fits in 90% of the free memory, measured now (after the previous phase freed its buffers)."""
    if args.local_rollout_forward_batch_size > 0:
        return args.local_rollout_forward_batch_size
    if model is None:  # no forward pass to size
        return rows
    per_row = forward_bytes_per_row(model.config, phase, args.max_prompt_length, args.response_length,
                                    2 if args.bf16 else 4, k)
    return max(1, min(rows, int(0.9 * free_memory_bytes(device) // per_row)))


def mismatch_metrics(rollout, cliprange: float, cliprange_high: float, cap: Optional[float] = None,
                     correction: Optional[Callable] = None) -> dict[str, float]:
    """How far the sampler's log-probs of its tokens are from the trainer's (the PPO ratio's denominator), for one
    rank's (k*B, Tr) rollout: per valid token, and as the sequence ratio p_trainer / p_sampler; mismatch/clipfrac:
    the share outside the loss's clip band [1 - cliprange, 1 + cliprange_high]. With `correction` (old, sampler,
    mask -> the importance weights the loss applies, rloo.importance_weights with its mode and `cap`): their mean
    and the share of ratios above the cap."""
    mask = rollout.response_mask
    diff = (rollout.logprobs - rollout.sampler_logprobs).double() * mask  # (k*B, Tr)
    ratio = diff.sum(1).exp()  # (k*B,)
    out = {"mismatch/logprob_diff_mean": (diff.abs().sum() / mask.sum().clamp(min=1)).item(),
           "mismatch/logprob_diff_max": diff.abs().max().item(),
           "mismatch/ratio_mean": ratio.mean().item(),
           "mismatch/ratio_std": ratio.std().item() if ratio.numel() > 1 else 0.0,
           "mismatch/clipfrac": ((ratio < 1 - cliprange) | (ratio > 1 + cliprange_high)).double().mean().item()}
    if correction is not None:
        weights = correction(rollout.logprobs.double(), rollout.sampler_logprobs.double(), mask)
        raw = ratio if weights.dim() == 1 else diff.exp()  # (k*B,) or (k*B, Tr)
        counted = torch.ones_like(weights) if weights.dim() == 1 else mask.double()  # the weights that act
        n = counted.sum().clamp(min=1)
        out["mismatch/is_weight_mean"] = ((weights * counted).sum() / n).item()
        out["mismatch/is_capped_frac"] = (((raw > cap) * counted).sum() / n).item()
    return out


def sum_over_updates(value_at: Callable[[int], float], num_updates: int, most: int = 10_000) -> float:
    """value_at(u) summed over the updates u = 1 .. num_updates: exactly up to `most` updates, else estimated from
    `most` evenly spread ones (the midpoints of equal spans), so that start-up work stays bounded."""
    if num_updates <= most:
        return sum(value_at(u) for u in range(1, num_updates + 1))
    return num_updates / most * sum(value_at(1 + int((i + 0.5) * num_updates / most)) for i in range(most))


def movement_note(trainable: list, args, learning_rate_sum: float) -> list[str]:
    """A start-up line: how far the run's learning rates can move the policy's weights. An AdamW step moves a weight
    by about the learning rate at most (the gradient's running mean over its running RMS), so the whole run by at
    most the sum of its steps' learning rates, set here against the RMS of the trained matrices. None with LoRA
    (the adapters start at 0) or FSDP (the weights are sharded)."""
    if args.use_peft or args.fsdp:
        return []
    matrices = [p.detach() for p in trainable if p.dim() >= 2]
    squares = sum(m.float().square().sum().item() for m in matrices)
    rms = math.sqrt(squares / max(1, sum(m.numel() for m in matrices)))
    total = f"the learning rates of the run's optimizer steps sum to {learning_rate_sum:.3g}"
    return [f"{total}: AdamW moves each weight by at most about that much, {learning_rate_sum / rms:.1%} of the "
            f"policy's weight RMS ({rms:.3g})" if rms > 0 else total]


class EvalTotals:
    """The evaluation's sums, reduced over every rank's completions by metrics(): eval/scores (the mean of the scored
    ones; NaN is a completion no source scored), eval/mean_length (tokens) and eval/eos_frac (those that stopped)."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros(5, dtype=torch.float64, device=device)  # score sum, scored, length sum, stops, count

    def add(self, scores: torch.Tensor, response_mask: torch.Tensor, ended: torch.Tensor) -> None:
        """A chunk's scores (N,), response mask (N, Tr) and whether each stopped (N,)."""
        self.total += torch.tensor([scores.nansum().item(), (~scores.isnan()).sum().item(), response_mask.sum().item(),
                                    ended.sum().item(), len(scores)], dtype=torch.float64, device=self.total.device)

    def metrics(self) -> dict[str, float]:  # a collective
        score_sum, scored, length_sum, stops, count = all_reduce(self.total).tolist()
        count = max(count, 1.0)
        return {"eval/scores": score_sum / max(scored, 1.0), "eval/mean_length": length_sum / count,
                "eval/eos_frac": stops / count}
