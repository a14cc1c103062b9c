"""REINFORCE Leave-One-Out (RLOO) for RLHF, in one file.

    python rloo.py --model_name_or_path PATH --reward_model_path PATH --dataset_name NAME ...
    torchrun --nproc_per_node 8 rloo.py --rloo-k 4 ...

One update, on every rank:
  1. draw B prompts; each gets k completions, kept in the (k, B) layout: row j*B + i is sample j of prompt i;
  2. sample the k*B completions, cut each after its first stop token;
  3. recompute the policy's and the frozen reference's log-probs of those tokens with a forward pass (on-policy,
     the training forward gives the policy's); every pass computes each prompt once for its k completions;
  4. score each completion (reward model and/or reward functions, missing-EOS penalty);
  5. reward = score - kl_coef * KL(policy || reference); the baseline of each sample is the mean reward
     of the other k-1 samples of its prompt; advantage = reward - baseline;
  6. num_ppo_epochs x shuffled minibatches x micro-batches of the clipped surrogate on the sequence-level
     ratio exp(sum_t logp_new - sum_t logp_old); one optimizer step per minibatch.
With 1 epoch and 1 minibatch the ratio is 1 and this is REINFORCE with the leave-one-out baseline.

Shapes: B prompts per rank and update; k = rloo_k completions each; N = k*B completions, in the (k, B) layout
(row j*B + i is sample j of prompt i); Tq the batch's longest prompt (left-padded), Tr its longest response
(right-padded, at most response_length); V the vocabulary; g prompt groups in a chunk or micro-batch, L the length
of a grouped row (a prompt, then its k responses back to back), P the positions whose logits it computes; S reward
sources.

Sections, in the order a run needs them; what nobody changes when changing the algorithm (the run's flags,
checkpoints, faults, signals, measuring, logging, file loading, kernels, the prompt-sharing start-up check, the command
line) is in plumbing.py, called as plumbing.X: copying this file means copying that one with it.
  Args                the algorithm's flags, TRL <= 0.21's names (TRL >= 0.22's accepted); models, data and the
                      run's in plumbing.RunArgs
  batch arithmetic    micro / mini / local / B / all ranks, derived once, with exact divisions
  data                a prompt's token ids; the sampler that draws B prompts per update
  models              the policy and its frozen reference (a copy, or with LoRA the adapters switched off)
  rollout             1-3: sampling with a KV cache, Completions, grouped rows (each prompt computed once for its k
                      completions), log-probs, the rollout source (LocalRollouts)
  rewards             4: reward model and reward functions, combined; the missing-EOS penalty
  advantages          5: KL-penalized reward, the leave-one-out baseline
  loss                6: the clipped surrogate on the sequence-level ratio
  update              6: PPO epochs x shuffled minibatches x micro-batches (DDP syncs gradients on the last
                      micro-step); no step on a NaN
  evaluation          near-greedy completions of test prompts, scored
  main                set-up, then each update's six steps inline: sample, score, advantages and PPO epochs, log,
                      evaluate, save
"""

import contextlib
import copy
import functools
import math
import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, ClassVar, Literal, Optional

# OpenMP's threads that wait for work sleep instead of spinning: the same results, and on a CPU that other work
# shares, runs several times faster (docs/speed-and-memory.md). OpenMP reads it once, when torch loads it; a value
# of the user's own is kept. rloo_multinode.py and plan_memory.py set it the same way before importing torch
os.environ["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY") or "PASSIVE"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import plumbing  # noqa: E402


@dataclass
class Args(plumbing.RunArgs):
    """The algorithm's flags; plumbing.RunArgs adds the run's (models, data, output_dir, checkpoints, memory and speed,
    LoRA, logging)."""

    # ----- RLOO -----
    rloo_k: int = 2
    """completions sampled per prompt (k >= 2: the baseline of each is the mean of the other k-1)"""
    kl_coef: float = 0.05
    """weight of the KL penalty to the reference policy; 0 skips the reference model entirely"""
    token_level_kl: bool = False
    """per-token KL penalties with token-level returns (each token's advantage sees the KL of the tokens
    after it) instead of one sequence-level penalty; the loss then uses per-token ratios"""
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of completions that never emit the stop token ("EOS trick")"""
    normalize_reward: bool = False
    """standardize scores over the global batch, then clip them to +-reward_clip_range"""
    reward_clip_range: float = 10.0
    """clip range of the normalized scores"""
    normalize_advantage: bool = False
    """whiten advantages over the global batch"""
    cliprange: float = 0.2
    """PPO clip range of the sequence-level ratio"""
    vllm_importance_sampling_correction: bool = False
    """weight each completion's loss (each token's, in token modes) by its truncated importance ratio of the trainer's
    old log-probs to the sampler's: corrects the mismatch the mismatch/* metrics measure (TRL GRPO's flag)"""
    vllm_importance_sampling_mode: Literal["sequence_truncate", "sequence_mask", "token_truncate", "token_mask"] = \
        "sequence_truncate"
    """sequence: one ratio exp(sum_t logp_trainer - logp_sampler) per completion; token: one per token (needs
    --token_level_kl, whose loss has per-token actions). truncate: min(ratio, cap); mask: the ratio, 0 above the cap"""
    vllm_importance_sampling_cap: float = 3.0
    """the cap C of --vllm_importance_sampling_correction"""

    # ----- generation -----
    response_length: int = 53
    """tokens sampled per completion"""
    temperature: float = 0.7
    """sampling temperature (top_k=0, top_p=1); logits are divided by it when log-probs are computed"""
    stop_token: Optional[Literal["eos"]] = "eos"
    """truncate completions after the first EOS; None keeps all response_length tokens"""
    stop_token_id: Optional[int] = None
    """truncate after this token id instead (overrides --stop_token)"""

    # ----- optimization -----
    total_episodes: Optional[int] = None
    """completions to train on, all ranks together; None is num_train_epochs x the number of prompts"""
    num_train_epochs: float = 1.0
    """used only when --total_episodes is None"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass, per rank (the micro-batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per PPO epoch"""
    num_ppo_epochs: int = 4
    """passes over each update's completions"""
    learning_rate: float = 3e-6
    """AdamW learning rate"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """linear decay to 0 over the run, or constant"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this (<= 0: no clipping, the norm is still logged)"""


# ===================================================================== batch arithmetic
@dataclass(frozen=True)
class BatchSizes:
    micro: int  # completions per forward/backward pass, per rank
    mini: int  # completions per optimizer step, per rank = micro * gradient_accumulation_steps
    local: int  # completions per update, per rank = mini * num_mini_batches = k * prompts
    prompts: int  # B: prompts per update, per rank = local / k
    all_ranks: int  # completions per update, all ranks = local * world_size


def compute_batch_sizes(args: Args, world_size: int) -> BatchSizes:
    """The one place where batch sizes are derived; every division is exact or refused."""
    if args.rloo_k < 2:
        raise plumbing.ConfigError(f"rloo_k = {args.rloo_k}: the leave-one-out baseline needs at least 2 completions "
                                   "per prompt; pass --rloo_k 2 or more")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs"):
        if getattr(args, name) < 1:
            raise plumbing.ConfigError(f"{name} = {getattr(args, name)} must be at least 1")
    micro = args.per_device_train_batch_size
    mini = micro * args.gradient_accumulation_steps
    local = mini * args.num_mini_batches
    if local % args.rloo_k:
        raise plumbing.ConfigError(f"per_device_train_batch_size ({micro}) x gradient_accumulation_steps "
                                   f"({args.gradient_accumulation_steps}) x num_mini_batches ({args.num_mini_batches})"
                                   f" = {local} completions per rank is not divisible by rloo_k ({args.rloo_k}); make "
                                   "the product a multiple of rloo_k")
    return BatchSizes(micro=micro, mini=mini, local=local, prompts=local // args.rloo_k,
                      all_ranks=local * world_size)


# ===================================================================== data
def prompt_token_ids(rows: dict, tokenizer, prompt_column: str) -> list[list[int]]:
    """Token ids of a batch of dataset rows: a string prompt, chat messages, or pre-tokenized `query_token`."""
    if prompt_column in rows:
        prompts = rows[prompt_column]
        if prompts and isinstance(prompts[0], list):  # chat messages
            if tokenizer.chat_template is None:
                raise plumbing.ConfigError(f"column {prompt_column!r} holds chat messages but the tokenizer has no "
                                           "chat template")
            texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
            return tokenizer(texts, add_special_tokens=False)["input_ids"]
        return tokenizer(prompts)["input_ids"]
    # TL;DR schema: queries pre-tokenized and left-padded with the pad id; strip the padding
    return [[t for t in ids if t != tokenizer.pad_token_id] for ids in rows["query_token"]]


class PromptSampler:
    """Each rank's B prompt indices per update. The dataset is cycled, reshuffled every epoch; every rank
    computes the same permutation from (seed, epoch) and takes its own slice, so no communication is needed."""

    def __init__(self, num_prompts: int, prompts_per_rank: int, rank: int, world_size: int, seed: int):
        self.per_update = prompts_per_rank * world_size
        if num_prompts < self.per_update:
            raise plumbing.ConfigError(f"the training split has {num_prompts} prompts, fewer than one update takes "
                                       f"({prompts_per_rank} per rank x {world_size} ranks); use a larger dataset or "
                                       "smaller batches")
        self.num_prompts, self.prompts_per_rank, self.rank, self.seed = num_prompts, prompts_per_rank, rank, seed
        self.epoch, self.position = 0, 0
        self._permutation = self._shuffle()

    def _shuffle(self) -> torch.Tensor:
        return torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._permutation = self._shuffle()

    def next_indices(self) -> list[int]:
        if self.position + self.per_update > self.num_prompts:  # drop the epoch's remainder, reshuffle
            self.epoch, self.position = self.epoch + 1, 0
            self._permutation = self._shuffle()
        start = self.position + self.rank * self.prompts_per_rank
        self.position += self.per_update
        return self._permutation[start : start + self.prompts_per_rank].tolist()


# ===================================================================== models
def load_policy(args: Args, device: torch.device, checkpoint: Optional[Path] = None, tokenizer=None):
    """The policy (fp32 master weights, or with --use_peft LoRA adapters on the base; from the checkpoint when
    resuming), its frozen reference, always the initial policy (None when kl_coef = 0; with LoRA, AdaptersOff), the
    tokenizer with a pad token, and the stop token id."""
    tokenizer_path = args.model_name_or_path or args.sft_model_path
    initial_path = args.sft_model_path or args.model_name_or_path
    if tokenizer is None:
        tokenizer, _ = plumbing.prepare_tokenizer(args)
    policy = plumbing.load_causal_lm(initial_path, torch.float32, args.trust_remote_code,
                                     weights=None if args.use_peft else checkpoint)  # LoRA: the base, never trained
    plumbing.ensure_pad_token(tokenizer, args.pad_token, policy.get_input_embeddings().num_embeddings, tokenizer_path)
    policy.config.pad_token_id = tokenizer.pad_token_id
    stop_token_id = plumbing.stop_token_id_of(args, tokenizer, tokenizer_path)
    plumbing.disable_dropout(policy)
    if args.use_peft:
        plumbing.add_adapters(policy, args, checkpoint)
    if not args.offload:  # offloaded, fully_shard moves one unit at a time through the GPU as it shards
        policy.to(device)
    frozen_home = torch.device("cpu") if args.offload else device
    ref_policy = None
    if args.kl_coef != 0 and args.use_peft:
        ref_policy = plumbing.AdaptersOff(policy)
    elif args.kl_coef != 0:
        frozen_dtype = torch.bfloat16 if args.bf16 else torch.float32
        ref_policy = copy.deepcopy(policy) if checkpoint is None else \
            plumbing.load_causal_lm(initial_path, frozen_dtype, args.trust_remote_code)  # its own dtype, not fp32
        plumbing.disable_dropout(ref_policy)
        ref_policy.to(frozen_home, frozen_dtype).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy, ref_policy, tokenizer, stop_token_id


# ===================================================================== rollout
def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, T) positions counting real tokens only, so left padding does not shift them."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def sample_tokens(logits: torch.Tensor, temperature: float,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(N,) one token per row of (N, V) logits, from softmax(logits / temperature), by inverse-CDF sampling: one
    exp, a cumulative sum and one uniform number per row (from `generator`, else the global RNG). torch.multinomial
    draws an exponential variate per vocabulary entry, ~10x slower at V = 50k on CPU."""
    scaled = logits / temperature  # (N, V)
    cdf = (scaled - scaled.max(-1, keepdim=True).values).exp_().cumsum_(-1)  # (N, V) unnormalized
    # (N, 1) uniform in [0, total)
    u = torch.rand(logits.shape[0], 1, device=logits.device, generator=generator) * cdf[:, -1:]
    # the first token whose cumulative mass exceeds u; a zero-probability token never does
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)


@torch.no_grad()
def generate(
    model, queries: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int, temperature: float,
    stop_token_id: Optional[int], pad_token_id: int, generator: Optional[torch.Generator] = None,
    decoder: Optional[plumbing.StaticDecoder] = None, k: int = 1, logprobs_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sample k continuations of each of the g left-padded queries (g, Tq): (k*g, max_new_tokens) tokens in the
    (k, g) layout, row j*g + i continuing query i; top_k=0, top_p=1 (temperature 0: greedy). Each query is prefilled
    once, its cache copied to its k rows: preallocated (a `decoder`'s: its compiled step), or for state-space and
    recurrent layers the prefill's own. A row is padded after its stop token. `logprobs_out` (k*g, max_new_tokens),
    if given, receives the sampler's log-prob of each drawn token: log_softmax(logits / temperature), as the
    trainer computes it."""
    from transformers import DynamicCache

    g, width = queries.shape
    position_ids = position_ids_from_mask(query_mask)  # (g, Tq)
    # a sliding layer's own prefill cache keeps only its last window - 1 keys and the preallocated cache would count
    # from there: keep every key, the preallocated cache keeps the window it needs and counts from the prompt's end
    windows = plumbing.attention_windows(model)
    windowed = any(window is not None for window in (windows or {}).values())
    prefill = model(input_ids=queries, attention_mask=query_mask.long(), position_ids=position_ids, use_cache=True,
                    past_key_values=DynamicCache() if windowed else None,
                    **({"logits_to_keep": 1} if plumbing.accepts_logits_to_keep(model) else {}))  # the next token's
    prompt_of_row = torch.arange(g, device=queries.device).repeat(k)  # (k*g,) the (k, g) layout
    prefill.past_key_values.reorder_cache(prompt_of_row)  # each layer's (g, heads, Tq, head_dim) -> (k*g, ...)
    grown = windows is None  # state-space / recurrent layers: the copy below would drop their state
    if grown or decoder is None:
        step, length = model, width + max_new_tokens
        cache = prefill.past_key_values if grown else plumbing.preallocated_cache(model.config, length,
                                                                                  prefill.past_key_values)
    else:
        step, length = decoder.step, decoder.max_length
        cache = decoder.cache_holding(prefill.past_key_values, k * g)
    # (k*g, L) mask over the whole cache: the prompts' real tokens, then each generated position as it is written
    attention_mask = torch.nn.functional.pad(query_mask.long()[prompt_of_row], (0, length - width))
    logits = prefill.logits[:, -1].float()[prompt_of_row]  # (k*g, V): the k rows of a prompt start alike
    next_position = position_ids[prompt_of_row, -1:] + 1  # (k*g, 1)
    done = torch.zeros(k * g, dtype=torch.bool, device=queries.device)  # (k*g,)
    tokens = torch.full((k * g, max_new_tokens), pad_token_id, device=queries.device)  # (k*g, Tr)
    for t in range(max_new_tokens):
        token = sample_tokens(logits, temperature, generator) if temperature > 0 else logits.argmax(-1)  # (k*g,)
        token = torch.where(done, pad_token_id, token)
        tokens[:, t] = token
        if logprobs_out is not None:  # what the sampler gave the token it drew: for the mismatch metrics (k*g,)
            scaled = logits / temperature  # (k*g, V)
            logprobs_out[:, t] = scaled.gather(1, token[:, None])[:, 0] - scaled.logsumexp(-1)
        if stop_token_id is not None:
            done |= token == stop_token_id
        if t == max_new_tokens - 1 or done.all():
            break
        attention_mask[:, width + t] = 1
        out = step(input_ids=token[:, None], attention_mask=attention_mask[:, : width + t + 1] if grown else
                   attention_mask, position_ids=next_position, past_key_values=cache, use_cache=True)
        logits, next_position = out.logits[:, -1].float(), next_position + 1
    return tokens


def truncate_after_stop(
    responses: torch.Tensor, stop_token_id: Optional[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything after the first stop token becomes padding. Returns (responses, mask), both (N, T);
    the mask is True up to and including the stop token."""
    if stop_token_id is None:
        return responses, torch.ones_like(responses, dtype=torch.bool)
    is_stop = responses == stop_token_id  # (N, T)
    after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 0  # (N, T): a stop token strictly before
    return responses.masked_fill(after_stop, pad_token_id), ~after_stop


def completion_rows(prompts: torch.Tensor, num_prompts: int, k: int) -> torch.Tensor:
    """(k*g,) the rows, in a (k, B) layout of num_prompts = B prompts, of the completions of g prompts, in the
    (k, g) layout: row j*g + i of the result is sample j of prompts[i]."""
    return (torch.arange(k, device=prompts.device)[:, None] * num_prompts + prompts[None, :]).flatten()


@dataclass
class Completions:
    """k sampled completions of each of B prompts. Each prompt is held once, (B, Tq); the responses are in the
    (k, B) layout, (k*B, Tr): row j*B + i is sample j of prompt i. Evaluation samples one per prompt (k = 1)."""

    queries: torch.Tensor  # (B, Tq) token ids, left-padded
    query_mask: torch.Tensor  # (B, Tq) bool: real prompt tokens
    responses: torch.Tensor  # (k*B, Tr) token ids, padding after the stop token
    response_mask: torch.Tensor  # (k*B, Tr) bool: response tokens up to and including the stop token
    # (k*B, Tr) the sampler's own log-probs of the tokens it drew (0 on padding), as it computed them while sampling
    # (a bf16 copy, an engine, vLLM): compared with the trainer's (mismatch/*); None where the sampler gave none
    sampler_logprobs: Optional[torch.Tensor] = field(default=None, kw_only=True)

    PER_PROMPT: ClassVar[tuple[str, ...]] = ("queries", "query_mask")  # every other tensor has a row per completion

    @property
    def k(self) -> int:
        return self.responses.shape[0] // self.queries.shape[0]

    def ended(self, stop_token_id: Optional[int]) -> torch.Tensor:
        """(k*B,) bool: the completion emitted the stop token."""
        if stop_token_id is None:
            return torch.zeros(self.responses.shape[0], dtype=torch.bool, device=self.responses.device)
        return ((self.responses == stop_token_id) & self.response_mask).any(1)

    def map_tensors(self, per_prompt: Callable, per_completion: Callable) -> "Completions":
        """A copy (of the same class) with per_prompt(t) of each per-prompt tensor, per_completion(t) of the others."""
        return replace(self, **{f.name: None if getattr(self, f.name) is None else
                                (per_prompt if f.name in self.PER_PROMPT else per_completion)(getattr(self, f.name))
                                for f in fields(self)})

    def of_prompts(self, prompts: torch.Tensor) -> "Completions":
        """The completions of g of the prompts (B indices), (k, g) layout, cut to their own widths: the longest of
        their prompts and of their responses (the padding columns all of them share are dropped)."""
        rows = completion_rows(prompts, self.queries.shape[0], self.k)  # (k*g,)
        prompt_width = int(self.query_mask[prompts].sum(1).max())
        response_width = int(self.response_mask[rows].sum(1).max())
        return self.map_tensors(lambda t: t[prompts, -prompt_width:],
                                lambda t: t[rows, :response_width] if t.dim() == 2 else t[rows])  # (k*g, ..)

    def one_per_row(self, rows: torch.Tensor) -> "Completions":
        """Completions `rows` (indices into k*B) as k = 1 completions, each with its own copy of its prompt (for
        micro-batches that split prompt groups), cut to their own widths."""
        prompts = rows % self.queries.shape[0]  # (n,)
        single = self.map_tensors(lambda t: t[prompts], lambda t: t[rows])
        return single.of_prompts(torch.arange(len(rows), device=rows.device))


@dataclass
class GroupedRows:
    """A forward pass's inputs with one row per prompt group, (g, L): the prompt (left-padded), then its k responses
    back to back, each at its own length, the row right-padded to the longest group. The 4D mask lets each response
    attend to the prompt's real tokens and to its own earlier tokens only, and its positions count on from the
    prompt's, so every completion is computed exactly as alone while its prompt is computed once."""

    input_ids: torch.Tensor  # (g, L)
    position_ids: torch.Tensor  # (g, L)
    attention_mask: torch.Tensor | dict  # (g, 1, L, L) bool (True: attend), or additive floats for eager attention;
    # one per layer type ({"sliding_attention": mask, ...}) where the model's layers have different windows
    predictors: torch.Tensor  # (P,) the positions whose logits are computed, the same in every row: the prompt's last
    # position k times (it predicts each response's first token), then every response position but the row's last
    targets: torch.Tensor  # (g, P) the token each predictor predicts in its row (0 where it predicts nothing)
    slots: torch.Tensor  # (k*g, Tr) which of the P predictors predicts each response token, (k, g) layout
    last_positions: torch.Tensor  # (k*g,) each completion's last token in its group's row

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}


def grouped_rows(c: Completions, float_mask_dtype: Optional[torch.dtype] = None,
                 windows: Optional[dict] = None) -> GroupedRows:
    """The completions as GroupedRows; padding ids become 0 (they may lie outside a reward model's vocabulary).
    `windows` (attention_windows): a sliding layer's query sees a key only within its window, counted in the
    positions the completion has alone (in the row, other responses may sit between them)."""
    (g, prompt_width), k, response_width, device = c.queries.shape, c.k, c.responses.shape[1], c.queries.device
    lengths = c.response_mask.sum(1).view(k, g).T  # (g, k) each response's own length
    starts = prompt_width + lengths.cumsum(1) - lengths  # (g, k) where each response begins in its row
    length = prompt_width + int(lengths.sum(1).max())  # L
    t = torch.arange(response_width, device=device)  # (Tr,)
    real = t < lengths[:, :, None]  # (g, k, Tr) the response tokens, of every (group, sample)
    where = (starts[:, :, None] + t)[real]  # (n,) their positions in their rows
    row = torch.arange(g, device=device)[:, None, None].expand_as(real)[real]  # (n,) and their rows
    sample = torch.arange(k, device=device)[None, :, None].expand_as(real)[real]  # (n,) and which response
    responses = c.responses.view(k, g, response_width).transpose(0, 1)  # (g, k, Tr)

    input_ids = torch.zeros(g, length, dtype=torch.long, device=device)
    input_ids[:, :prompt_width] = c.queries.masked_fill(~c.query_mask, 0)
    input_ids[row, where] = responses[real]
    position_ids = torch.zeros_like(input_ids)
    position_ids[:, :prompt_width] = position_ids_from_mask(c.query_mask)
    position_ids[row, where] = (c.query_mask.sum(1)[:, None, None] + t).expand_as(real)[real]
    segment = torch.full_like(input_ids, -2)  # (g, L): -1 the prompt, j response j, -2 the row's padding
    segment[:, :prompt_width] = -1
    segment[row, where] = sample
    index = torch.arange(length, device=device)
    prompt_key = torch.cat([c.query_mask, torch.zeros(g, length - prompt_width, dtype=torch.bool, device=device)], 1)
    own_key = (segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] >= 0)  # (g, L, L) same response
    mask = (index[:, None] >= index[None, :]) & (prompt_key[:, None, :] | own_key)  # (g, L, L)
    mask |= torch.eye(length, dtype=torch.bool, device=device)  # padding attends to itself: no softmax row is empty
    windows = {kind: w if w is not None and w < length else None  # a window no row outgrows is no window
               for kind, w in (windows or {None: None}).items()}
    masks = {}  # window -> (g, 1, L, L)
    for window in set(windows.values()):
        within = (mask if window is None else  # as alone: pos_q - window < pos_k <= pos_q
                  mask & (position_ids[:, :, None] - position_ids[:, None, :] < window))[:, None]
        masks[window] = within if float_mask_dtype is None else torch.zeros(
            within.shape, dtype=float_mask_dtype, device=device).masked_fill_(
            ~within, torch.finfo(float_mask_dtype).min)
    mask = next(iter(masks.values())) if len(masks) == 1 else {kind: masks[w] for kind, w in windows.items()}

    # logits: the prompt's last position once per response (its first token), then the positions in between
    predictors = torch.cat([torch.full((k,), prompt_width - 1, device=device),
                            torch.arange(prompt_width, length - 1, device=device)])  # (P,)
    slots = torch.where(t == 0, torch.arange(k, device=device)[None, :, None],
                        k + starts[:, :, None] - prompt_width + t - 1)  # (g, k, Tr); past a response's end: unread
    slots = slots.clamp(max=len(predictors) - 1)
    targets = torch.zeros(g, len(predictors), dtype=torch.long, device=device)
    targets[row, slots[real]] = responses[real]
    return GroupedRows(input_ids, position_ids, mask, predictors, targets,
                       slots.transpose(0, 1).reshape(k * g, response_width),
                       (starts + lengths - 1).T.reshape(k * g))


def grouped_rows_for(model, c: Completions) -> GroupedRows:
    """grouped_rows with the mask in the form the model's attention takes: additive for eager attention, windowed
    and one per layer type as its layers are."""
    eager = plumbing.attention_implementation(model) == "eager"
    return grouped_rows(c, float_mask_dtype=torch.float32 if eager else None, windows=plumbing.attention_windows(model))


def unshared_inputs(c: Completions, pad_id: int = 0) -> dict:
    """One row per completion, (k*g, Tq + Tr): its prompt (repeated for each of the k), then the response; padding
    masked. The layout transformers models are built for; --no-share_prompt and models that cannot take
    grouped_rows use it."""
    prompt_of_row = torch.arange(c.queries.shape[0], device=c.queries.device).repeat(c.k)  # (k*g,)
    attention_mask = torch.cat([c.query_mask[prompt_of_row], c.response_mask], 1)  # (k*g, Tq + Tr)
    input_ids = torch.cat([c.queries[prompt_of_row], c.responses], 1).masked_fill(~attention_mask, pad_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask.long(),
            "position_ids": position_ids_from_mask(attention_mask)}


def forward_logprobs(
    model, c: Completions, temperature: float, share_prompt: bool, with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (k*g, Tr) of the response tokens under logits / temperature and, if asked, the entropy (k*g, Tr) of
    each token's distribution (differentiable, as an entropy bonus needs: policy/entropy_avg, not objective/entropy,
    which sums the sampled tokens' -log-probs). Logits are computed only where a response token is predicted
    (plumbing.logits_at); padding positions hold values that must be masked."""
    if not share_prompt:  # position Tq - 1 + t predicts response token t
        positions = c.queries.shape[1] - 1 + torch.arange(c.responses.shape[1], device=c.responses.device)  # (Tr,)
        logits = plumbing.logits_at(model, positions, **unshared_inputs(c))  # (k*g, Tr, V)
        return plumbing.SelectiveLogSoftmax.apply(logits, c.responses, temperature, with_entropy)
    rows = grouped_rows_for(model, c)
    logits = plumbing.logits_at(model, rows.predictors, **rows.model_inputs())  # (g, P, V)
    # in the logits' own layout, so that only the (g, P) results are rearranged, never the (.., V) logits
    logprobs, entropy = plumbing.SelectiveLogSoftmax.apply(logits, rows.targets, temperature,
                                                           with_entropy)  # (g, P) each
    group = torch.arange(c.queries.shape[0], device=logits.device).repeat(c.k)[:, None]  # (k*g, 1)
    return logprobs[group, rows.slots], None if entropy is None else entropy[group, rows.slots]


@dataclass
class Rollout(Completions):
    """One rank's completions of one update, k*B rows in the (k, B) layout, with their log-probs."""

    logprobs: Optional[torch.Tensor]  # (k*B, Tr) under the policy that sampled, by a forward pass (0 on padding);
    # None until the update's own forward fills them, when that is the same forward (on-policy: logprobs_from_update)
    ref_logprobs: Optional[torch.Tensor]  # (k*B, Tr) reference log-probs (0 on padding); None if kl_coef = 0
    # set by ppo_update (compute_advantages): what it trained on, for the metrics
    advantages: Optional[torch.Tensor] = field(default=None, kw_only=True)  # (k*B,), or (k*B, Tr) per token
    rlhf_reward: Optional[torch.Tensor] = field(default=None, kw_only=True)  # (k*B,) score - kl_coef * KL


@torch.no_grad()
def sample_completions(
    policy, queries: torch.Tensor, query_mask: torch.Tensor, response_length: int, temperature: float,
    stop_token_id: Optional[int], pad_token_id: int, generator: Optional[torch.Generator] = None,
    decoder: Optional[plumbing.StaticDecoder] = None, k: int = 1,
) -> Completions:
    """Sample k completions of each (g, Tq) query, (k, g) layout, and cut each after its first stop token."""
    responses = generate(policy, queries, query_mask, response_length, temperature, stop_token_id, pad_token_id,
                         generator, decoder, k)
    responses, response_mask = truncate_after_stop(responses, stop_token_id, pad_token_id)  # (k*g, Tr) each
    return Completions(queries, query_mask, responses, response_mask)


def chunks_by_prompt_length(query_mask: torch.Tensor, prompts_per_chunk: int) -> list[torch.Tensor]:
    """The B prompt indices in chunks of prompts_per_chunk, sorted by prompt length, so that each chunk pads to
    its own longest prompt, not the batch's."""
    order = torch.argsort(query_mask.sum(1), stable=True)  # (B,)
    return list(order.split(max(1, prompts_per_chunk)))


def put_rows(into: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """into[rows] = values: a chunk's or micro-batch's (n,) values, or (n, w) cut to its own width w, back in a
    (k*B,) or (k*B, Tr) tensor."""
    into[(rows, slice(values.shape[1])) if values.dim() == 2 else rows] = values


def in_chunks(c: Completions, completions_per_chunk: int, compute: Callable, width: Optional[int] = None):
    """compute(chunk) for length-sorted chunks of whole prompt groups (about completions_per_chunk completions
    each), put back in c's (k*B,) row order: (k*B,) results, or (k*B, width) padded with zeros when each chunk's
    (k*g, w) results are cut to its own response width w <= width."""
    out = None
    for prompts in chunks_by_prompt_length(c.query_mask, completions_per_chunk // c.k):
        values = compute(c.of_prompts(prompts))  # (k*g,) or (k*g, w)
        if out is None:
            out = values.new_zeros((c.responses.shape[0],) + ((width,) if width is not None else ()))
        put_rows(out, completion_rows(prompts, c.queries.shape[0], c.k), values)
    return out


@torch.no_grad()
def sample_in_chunks(
    policy, queries: torch.Tensor, query_mask: torch.Tensor, k: int, args: Args, stop_token_id: Optional[int],
    pad_token_id: int, generator: torch.Generator, autocast, decoder: Optional[plumbing.StaticDecoder] = None,
) -> Completions:
    """k completions of each of the B (B, Tq) queries, (k, B) layout; local_rollout_forward_batch_size completions
    (whole prompt groups, length-sorted) at a time: the KV cache of a chunk is what must fit. Chunks draw from
    `generator` one after the other."""
    chunk = plumbing.rows_per_forward(args, policy, "generation", queries.device, k * queries.shape[0], k)
    responses = torch.full((k * queries.shape[0], args.response_length), pad_token_id, device=queries.device)
    sampler_logprobs = torch.zeros(responses.shape, device=queries.device)  # (k*B, Tr)
    with autocast():
        for prompts in chunks_by_prompt_length(query_mask, chunk // k):
            width = int(query_mask[prompts].sum(1).max())  # this chunk's longest prompt
            rows = completion_rows(prompts, queries.shape[0], k)
            logprobs = sampler_logprobs.new_zeros(len(rows), args.response_length)  # (k*g, Tr)
            responses[rows] = generate(
                policy, queries[prompts, -width:], query_mask[prompts, -width:], args.response_length,
                args.temperature, stop_token_id, pad_token_id, generator, decoder, k, logprobs)  # (k*g, Tr)
            sampler_logprobs[rows] = logprobs
    responses, response_mask = truncate_after_stop(responses, stop_token_id, pad_token_id)  # (k*B, Tr) each
    return Completions(queries, query_mask, responses, response_mask,
                       sampler_logprobs=sampler_logprobs * response_mask)  # 0 on padding


class LocalRollouts:
    """Where each update's completions come from: here sampled in this process by the policy being trained;
    rloo_multinode.py's engines behind the same five methods, `lookahead` batches ahead (0: on-policy)."""

    lookahead = 0
    max_metrics: tuple[str, ...] = ()  # metrics of its own that are reduced over ranks by their maximum

    def __init__(self, policy, args: Args, stop_token_id: Optional[int], pad_token_id: int,
                 generator: torch.Generator, autocast):
        self.args, self.stop_token_id, self.pad_token_id, self.generator = args, stop_token_id, pad_token_id, generator
        self.queued = []  # (B, Tq) queries and mask, oldest first
        # the module that samples: the policy under autocast, or a bf16 copy of it
        self.sampler = plumbing.bf16_copy(policy) if args.bf16_generation else policy
        self.autocast = contextlib.nullcontext if args.bf16_generation else autocast
        self.decoder = plumbing.StaticDecoder(self.sampler, args.max_prompt_length + args.response_length) \
            if args.compile_generation else None

    def submit(self, queries: torch.Tensor, query_mask: torch.Tensor) -> None:
        """Ask for rloo_k completions of each of the (B, Tq) queries."""
        self.queued.append((queries, query_mask))

    def take(self) -> tuple[Completions, dict[str, float]]:
        """The completions of the oldest submitted queries, and metrics about how they were made."""
        queries, query_mask = self.queued.pop(0)
        return sample_in_chunks(self.sampler, queries, query_mask, self.args.rloo_k, self.args, self.stop_token_id,
                                self.pad_token_id, self.generator, self.autocast, self.decoder), {}

    @contextlib.contextmanager
    def behaviour_policy(self, policy):
        """For a with-block: the module with the weights that sampled the batch just taken. Here the policy."""
        yield policy

    def policy_updated(self, update: int, policy) -> dict[str, float]:
        """Called on every rank after each update's optimizer steps; returns metrics."""
        if self.sampler is not policy:
            plumbing.copy_weights(policy, self.sampler)
        return {}

    def close(self) -> None:
        pass


def logprobs_from_update(args: Args, sizes: BatchSizes, lookahead: int) -> bool:
    """On-policy (one epoch, one minibatch, sampled by the weights being trained) the sampling policy's log-probs are
    the training forward's own, detached: the update computes them, a micro-batch of whole prompt groups at a time,
    instead of a separate pass. Not with --normalize_advantage, which needs them all before the first step."""
    return (args.num_ppo_epochs == 1 and args.num_mini_batches == 1 and lookahead == 0
            and sizes.micro % args.rloo_k == 0 and not args.normalize_advantage)


@torch.no_grad()
def collect_rollout(
    policy, ref_policy, completions: Completions, args: Args, share_prompt: bool, logprobs_from_update: bool,
    autocast, timer: plumbing.PhaseTimer,
) -> Rollout:
    """The completions' log-probs under the policy that sampled them (unless logprobs_from_update), then under the
    reference, each in length-sorted chunks of whole prompt groups."""
    c = completions

    def logprobs_of(model) -> torch.Tensor:
        chunk = plumbing.rows_per_forward(args, model, "logprobs", c.responses.device, c.responses.shape[0], c.k)
        logprobs = in_chunks(c, chunk, lambda part: forward_logprobs(model, part, args.temperature, share_prompt)[0],
                             width=c.responses.shape[1])  # (k*B, Tr)
        return logprobs * c.response_mask  # 0 on padding

    # recomputed with the training forward pass, not taken from sampling: the sequence-level ratio is the exp of
    # a sum, so small sampling-vs-training mismatches would blow up (bf16, fused kernels)
    logprobs = None
    if not logprobs_from_update:
        with timer("policy_forward"), autocast():
            logprobs = logprobs_of(policy)  # (k*B, Tr)
    ref_logprobs = None
    if ref_policy is not None:
        with timer("reference_forward"), plumbing.visiting(ref_policy, c.responses.device), autocast():
            ref_logprobs = logprobs_of(ref_policy)  # (k*B, Tr)
    return Rollout(c.queries, c.query_mask, c.responses, c.response_mask, logprobs, ref_logprobs,
                   sampler_logprobs=c.sampler_logprobs)


# ===================================================================== rewards
def last_true_index(mask: torch.Tensor) -> torch.Tensor:
    """(N,) index of the last True of each row of an (N, T) mask: the last real token under any padding."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # (N, T)
    return torch.where(mask.bool(), positions, -1).max(dim=1).values


@torch.no_grad()
def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(N,) reward of each (N, T) sequence, read at its last real token, whatever the padding side."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids.masked_fill(~attention_mask.bool(), 0),  # padding ids may lie outside its vocab
        attention_mask=attention_mask.long(), position_ids=position_ids_from_mask(attention_mask), use_cache=False,
    ).last_hidden_state  # (N, T, H)
    last = last_true_index(attention_mask)  # (N,)
    return model.score(hidden[torch.arange(hidden.shape[0], device=hidden.device), last]).squeeze(-1).float()


@torch.no_grad()
def reward_model_scores(model, c: Completions, share_prompt: bool) -> torch.Tensor:
    """(k*g,) reward of each completion, read at its last real token (the stop token when it has one). Shared: one
    forward row per prompt group (grouped_rows); else one per completion."""
    if not share_prompt:
        inputs = unshared_inputs(c)
        return sequence_rewards(model, inputs["input_ids"], inputs["attention_mask"])
    rows = grouped_rows_for(model, c)
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(**rows.model_inputs(), use_cache=False).last_hidden_state  # (g, L, H)
    group = torch.arange(c.queries.shape[0], device=hidden.device).repeat(c.k)  # (k*g,) the (k, g) layout
    last = rows.last_positions  # (k*g,)
    return model.score(hidden[group, last]).squeeze(-1).float()


def retokenize(texts: list[str], ended: list[bool], tokenizer,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Query + completion texts in another tokenizer, with its EOS where the completion stopped.
    Returns right-padded (ids, mask), both (N, T)."""
    encoded = tokenizer(texts)["input_ids"]
    sequences = [ids + [tokenizer.eos_token_id] if e and tokenizer.eos_token_id is not None else ids
                 for ids, e in zip(encoded, ended)]
    return plumbing.pad_sequences(sequences, 0, device, side="right")  # pad id 0: reward_model_scores masks padding


def combine_rewards(values: torch.Tensor, applies: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the sources that apply. values and applies (S, N), weights (S,) -> (N,)."""
    if not applies.any(0).all():
        missing = (~applies.any(0)).nonzero().flatten().tolist()
        raise plumbing.RewardFunctionError(f"no reward source applies to completions {missing[:10]} (every reward "
                                           "function returned None for them and there is no reward model)")
    return (values * applies * weights[:, None]).sum(0)


def score_completions(
    sources: plumbing.RewardSources, completions: Completions, rows: dict[str, list], prompt_column: str, tokenizer,
    stop_token_id: Optional[int], chunk_size: int, autocast,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(k*B,) combined score of each completion, and each source's mean. `rows`: the B dataset rows the completions
    came from (completion row j*B + i belongs to prompt i); reward functions get their prompts (prompt_values) and
    every other column."""
    c, n, device = completions, completions.responses.shape[0], completions.responses.device
    prompts = prompt_values(rows, prompt_column, tokenizer)  # (B,)
    columns = {column: values for column, values in rows.items() if column not in (plumbing.PROMPT_IDS, prompt_column)}
    completion_ids = [r[m].tolist() for r, m in zip(c.responses, c.response_mask)]
    ended = c.ended(stop_token_id).tolist()
    without_stop = [ids[:-1] if e else ids for ids, e in zip(completion_ids, ended)]
    texts = tokenizer.batch_decode(without_stop, skip_special_tokens=True)
    repeat = lambda xs: [xs[i % len(xs)] for i in range(n)]  # noqa: E731  (B,) -> (k*B,) in the (k, B) layout
    values, applies = [], []
    if sources.model is not None and sources.model_tokenizer is None:  # the policy's token ids, as they are
        with autocast():
            values.append(in_chunks(c, chunk_size, lambda part: reward_model_scores(
                sources.model, part, sources.share_prompt)).cpu())  # (k*B,)
        applies.append(torch.ones(n, dtype=torch.bool))
    elif sources.model is not None:  # decode query and completion together: the text between them is the tokenizer's
        query_ids = [q[m].tolist() for q, m in zip(c.queries, c.query_mask)]  # (B,) lists
        full_texts = tokenizer.batch_decode([query_ids[row % len(query_ids)] + ids for row, ids in
                                             enumerate(without_stop)], skip_special_tokens=True)
        scores = []
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            ids, mask = retokenize(full_texts[rows], ended[rows], sources.model_tokenizer, device)
            with autocast():
                scores.append(sequence_rewards(sources.model, ids, mask))
        values.append(torch.cat(scores).cpu())
        applies.append(torch.ones(n, dtype=torch.bool))
    for name, fn in sources.functions:
        v, a = plumbing.call_reward_function(
            name, fn, n, sources.timeout, prompts=repeat(prompts), completions=texts, completion_ids=completion_ids,
            **{column: repeat(vals) for column, vals in columns.items()},
        )
        values.append(v)
        applies.append(a)
    values, applies = torch.stack(values), torch.stack(applies)  # (S, N) each
    per_source = {
        f"reward/{name}/mean": (v[a].mean().item() if a.any() else float("nan"))
        for name, v, a in zip(sources.names, values, applies)
    }
    return combine_rewards(values, applies, sources.weights).to(device), per_source


def prompt_values(rows: dict, prompt_column: str, tokenizer) -> list:
    """What reward functions see as `prompts`: the dataset's prompt column, or the decoded query tokens."""
    if prompt_column in rows:
        return rows[prompt_column]
    return tokenizer.batch_decode(rows[plumbing.PROMPT_IDS], skip_special_tokens=True)


def apply_missing_eos_penalty(scores: torch.Tensor, has_stop: torch.Tensor, penalty: Optional[float]) -> torch.Tensor:
    """(N,) scores, minus the penalty where the completion never emitted the stop token."""
    return scores if penalty is None else torch.where(has_stop, scores, scores - penalty)


# ===================================================================== advantages
# The rule an advantage estimator keeps: it reads only a completion's own prompt group. On-policy the update computes
# the advantages of each micro-batch's whole groups as their log-probs arrive (logprobs_from_update), so that an
# estimator reading other groups would train on other values than on the plain path; tests/test_update.py checks
# the rule on whatever rloo_advantages is.
def in_groups(x: torch.Tensor, k: int) -> torch.Tensor:
    """(k*g, ...) rows in the (k, g) layout -> (k, g, ...): column i holds prompt i's k samples. The rows are
    sample-major (row j*g + i is sample j of prompt i); TRL's are prompt-major, so its `view(-1, k)` pasted here
    would group samples of k different prompts."""
    return x.reshape(k, -1, *x.shape[1:])


def leave_one_out_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """(k, g) rewards -> (k, g) mean reward of the other k-1 samples of the same prompt (column)."""
    k = rewards.shape[0]
    if k < 2:
        raise ValueError(f"rloo_k = {k}: the leave-one-out baseline needs k >= 2")
    return (rewards.sum(0, keepdim=True) - rewards) / (k - 1)


def rloo_advantages(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float, token_level: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The advantage estimator, on prompt groups: scores (k, g), per-token kl and response_mask (k, g, Tr), column i
    prompt i's k samples -> (advantages (k, g), or (k, g, Tr) with token_level; rlhf_reward (k, g)).

    Sequence level: reward = score - kl_coef * sum_t kl_t; advantage = reward - baseline.
    Token level: token t earns -kl_coef * kl_t, the last valid token also earns the score; the advantage of token t
    is its return-to-go minus the same baseline. Both give the same rlhf_reward (the return from token 0), and the
    same advantages when kl_coef = 0."""
    kl = kl * response_mask
    non_score_reward = -kl_coef * kl.sum(-1)  # (k, g)
    rlhf_reward = scores + non_score_reward  # (k, g)
    baseline = leave_one_out_baseline(rlhf_reward)  # (k, g)
    if not token_level:
        return rlhf_reward - baseline, rlhf_reward
    token_rewards = -kl_coef * kl  # (k, g, Tr)
    rows = token_rewards.flatten(0, 1)  # (k*g, Tr), a view: the score goes to each row's last valid token
    rows[torch.arange(len(rows)), last_true_index(response_mask.flatten(0, 1))] += scores.flatten()
    returns = token_rewards.flip(-1).cumsum(-1).flip(-1)  # (k, g, Tr): sum of rewards from token t on
    return (returns - baseline[..., None]) * response_mask, rlhf_reward


def whiten(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Standardize x with statistics over its masked entries on all ranks."""
    mean, std = plumbing.global_mean_std(x, mask)
    out = (x - mean) / (std + 1e-8)
    return out if mask is None else out * mask


def kl_to_reference(rollout: Rollout) -> torch.Tensor:
    """(k*B, Tr) per-token log-ratio of the sampling policy to the reference (0 without a reference, and on padding)."""
    if rollout.ref_logprobs is None:
        return torch.zeros_like(rollout.logprobs)
    return rollout.logprobs - rollout.ref_logprobs


def compute_advantages(c: Rollout, scores: torch.Tensor, args: Args) -> None:
    """c.advantages and c.rlhf_reward from the scores (k*g,) of c's completions (a rollout's, or on-policy a
    micro-batch's whole prompt groups) and their KL. The estimator's one caller: it hands it groups shaped (k, g),
    checks they come back so, and with --normalize_advantage whitens over every rank's batch."""
    k, g = c.k, c.queries.shape[0]
    advantages, rlhf_reward = rloo_advantages(in_groups(scores, k), in_groups(kl_to_reference(c), k),
                                              in_groups(c.response_mask, k), args.kl_coef, args.token_level_kl)
    if advantages.shape[:2] != (k, g) or rlhf_reward.shape != (k, g):
        raise ValueError(f"the advantage estimator returned advantages {tuple(advantages.shape)} and rlhf_reward "
                         f"{tuple(rlhf_reward.shape)} for groups (k, g) = {(k, g)}: it must keep that layout")
    advantages = advantages.flatten(0, 1)  # (k*g,), or (k*g, Tr)
    if args.normalize_advantage:
        advantages = whiten(advantages, None if advantages.dim() == 1 else c.response_mask)
    c.advantages, c.rlhf_reward = advantages, rlhf_reward.flatten()  # (k*g,)


# ===================================================================== loss
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def sequence_log_ratio(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       response_mask: torch.Tensor) -> torch.Tensor:
    """(N,) log of the completion's probability ratio new / old: the sum of per-token log-ratios over valid tokens."""
    return ((new_logprobs - old_logprobs) * response_mask).sum(1)


def importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       mode: str, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025; TRL GRPO's modes) of samples drawn by a sampler that is not the
    trainer's forward: the ratio p_trainer / p_sampler of each completion (N,) (sequence modes) or token (N, Tr)
    (token modes; 1 on padding), cut to `cap` (truncate) or zeroed above it (mask). Constants of the loss."""
    log_ratio = (old_logprobs - sampler_logprobs) * response_mask  # (N, Tr)
    ratio = (log_ratio.sum(1) if mode.startswith("sequence") else log_ratio).exp()  # (N,) or (N, Tr)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    return torch.where(ratio <= cap, ratio, 0.0)  # an infinite ratio too


def policy_loss(
    new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    cliprange: float, per_token: bool, entropy: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate's loss of each action (ppo_update sums them over loss_normalizer); log-probs, mask and
    entropy (N, Tr). per_token False: a completion is one action with the sequence ratio exp(sum_t new - sum_t old),
    advantages (N,) -> losses (N,). per_token True: each token is an action with its own ratio, advantages (N, Tr) or
    (N,) -> losses (N, Tr), 0 on padding. Each loss is multiplied by its importance weight, if given."""
    if per_token:
        log_ratio = (new_logprobs - old_logprobs) * response_mask  # (N, Tr)
        advantages = advantages if advantages.dim() == 2 else advantages[:, None]  # (N, Tr) or (N, 1)
        weight = response_mask.float()  # which entries count
    elif advantages.dim() == 1:
        log_ratio = sequence_log_ratio(new_logprobs, old_logprobs, response_mask)  # (N,)
        weight = torch.ones_like(advantages)
    else:
        raise ValueError("per-token advantages (N, Tr) need per-token actions (per_token, as with --token_level_kl)")
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_action = torch.max(losses, losses_clipped)  # (N,) or (N, Tr)
    if is_weights is not None:  # a sequence's weight is each of its tokens' in the per-token loss
        per_action = per_action * (is_weights if is_weights.dim() == per_action.dim() else is_weights[:, None])
    with torch.no_grad():  # under the names they are logged with, as are ppo_update's
        stats = {"policy/clipfrac_avg": masked_mean((losses_clipped > losses).float(), weight),
                 "policy/approxkl_avg": 0.5 * masked_mean(log_ratio**2, weight)}
        if entropy is not None:
            stats["policy/entropy_avg"] = masked_mean(entropy, response_mask)
    return per_action * weight if per_token else per_action, stats


def loss_normalizer(rollout: Rollout, minibatch: list[torch.Tensor]) -> torch.Tensor:
    """What each micro-batch's summed losses are divided by: the minibatch's completions per rank (averaged over
    ranks, as DDP and FSDP average gradients), counted before its first micro-batch, so that the loss does not depend
    on how it is cut into micro-batches. Per-token losses then give the mean of each completion's sum."""
    rows = torch.cat(minibatch)  # (n,) this rank's completions of the minibatch
    count = torch.tensor(float(len(rows)), device=rollout.responses.device)
    return plumbing.all_reduce(count) / (dist.get_world_size() if dist.is_initialized() else 1)


# ===================================================================== update
def minibatch_plan(rollout: Rollout, sizes: BatchSizes, k: int) -> list[list[torch.Tensor]]:
    """One PPO epoch: shuffled minibatches, each a list of micro-batches, each the rows (indices into k*B) it trains
    on. With micro a multiple of k the prompt groups are shuffled, and sorted by prompt length within a minibatch
    (each micro-batch pads to its own longest prompt; the gradient is a sum); else single completions."""
    num_prompts = rollout.queries.shape[0]
    if sizes.micro % k:
        order = torch.randperm(k * num_prompts, device=rollout.responses.device)  # (k*B,) completions
        return [list(minibatch.split(sizes.micro)) for minibatch in order.split(sizes.mini)]
    order = torch.randperm(num_prompts, device=rollout.responses.device)  # (B,) prompt groups
    plan = []
    for minibatch in order.split(sizes.mini // k):
        minibatch = minibatch[torch.argsort(rollout.query_mask[minibatch].sum(1), stable=True)]
        plan.append([completion_rows(groups, num_prompts, k) for groups in minibatch.split(sizes.micro // k)])
    return plan


def micro_batch(rollout: Rollout, rows: torch.Tensor, k: int) -> Rollout:
    """The rollout of a micro-batch's rows: whole prompt groups (rows from minibatch_plan) keep one prompt per
    group; other rows get a prompt each."""
    num_prompts = rollout.queries.shape[0]
    if len(rows) % k == 0 and torch.equal(rows, completion_rows(rows[: len(rows) // k], num_prompts, k)):
        return rollout.of_prompts(rows[: len(rows) // k])
    return rollout.one_per_row(rows)


def is_weights_of(batch: Rollout, args: Args) -> Optional[torch.Tensor]:
    """The importance weights of a micro-batch with --vllm_importance_sampling_correction, else None."""
    if not args.vllm_importance_sampling_correction:
        return None
    if batch.sampler_logprobs is None:
        raise plumbing.ConfigError("--vllm_importance_sampling_correction needs the sampler's log-probs, which this "
                                   "rollout source does not return: drop the flag")
    return importance_weights(batch.logprobs, batch.sampler_logprobs, batch.response_mask,
                              args.vllm_importance_sampling_mode, args.vllm_importance_sampling_cap)


def gradient_sync(model, enabled: bool):
    """DDP all-reduces gradients only when `enabled` (an optimizer step's last micro-step). FSDP reduce-scatters at
    every micro-step, as ZeRO-3 does: more traffic, but no rank ever holds a full-size gradient."""
    if isinstance(model, DDP) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def ppo_update(
    model, optimizer: torch.optim.Optimizer, rollout: Rollout, scores: torch.Tensor, args: Args, sizes: BatchSizes,
    share_prompt: bool, autocast,
) -> dict[str, float]:
    """num_ppo_epochs x shuffled minibatches (one optimizer step each) x micro-batches (gradient accumulation), as
    minibatch_plan cuts them. Advantages come from the scores (k*B,) by compute_advantages, before the first step;
    or on-policy (rollout.logprobs None) per micro-batch from its own forward, whose detached log-probs are the
    ratio's denominator. Leaves rollout.logprobs, advantages and rlhf_reward for the metrics; returns its own
    (policy/*, loss/policy_avg, val/ratio*), averaged over micro-steps (the loss: over minibatches)."""
    stats: dict[str, list[torch.Tensor]] = {}
    ratios, grad_norms = [], []
    device, k = scores.device, rollout.k
    max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
    logprobs_from_update = rollout.logprobs is None  # on-policy: the update's forward gives them
    if logprobs_from_update:  # filled below, a micro-batch at a time
        rollout.logprobs = torch.zeros(rollout.responses.shape, device=device)  # (k*B, Tr)
        rollout.advantages, rollout.rlhf_reward = None, torch.zeros_like(scores)  # (k*B,); the advantages below
    else:
        compute_advantages(rollout, scores, args)  # all groups at once: --normalize_advantage needs them all
    for _ in range(args.num_ppo_epochs):
        for minibatch in minibatch_plan(rollout, sizes, k):
            normalizer = loss_normalizer(rollout, minibatch)  # counted once: every micro-batch divides by it
            losses = []
            for micro_step, rows in enumerate(minibatch):
                batch = micro_batch(rollout, rows, k)  # (n, Tq') prompts, (n', Tr') responses, n' = len(rows)
                with gradient_sync(model, enabled=micro_step == len(minibatch) - 1), autocast():
                    new_logprobs, entropy = forward_logprobs(model, batch, args.temperature, share_prompt,
                                                             with_entropy=True)  # (n', Tr') each
                    if logprobs_from_update:  # whole prompt groups (logprobs_from_update): all that the estimator reads
                        batch.logprobs = new_logprobs.detach() * batch.response_mask
                        compute_advantages(batch, scores[rows], args)
                        if rollout.advantages is None:  # (k*B,), or (k*B, Tr) from a per-token estimator
                            rollout.advantages = scores.new_zeros(rollout.responses.shape[:batch.advantages.dim()])
                        for name in ("logprobs", "advantages", "rlhf_reward"):
                            put_rows(getattr(rollout, name), rows, getattr(batch, name))
                    action_losses, step_stats = policy_loss(
                        new_logprobs, batch.logprobs, batch.advantages, batch.response_mask, args.cliprange,
                        per_token=args.token_level_kl, entropy=entropy, is_weights=is_weights_of(batch, args))
                    loss = action_losses.sum() / normalizer
                    loss.backward()
                losses.append(loss.detach())
                for key, value in step_stats.items():
                    stats.setdefault(key, []).append(value)
                ratios.append(torch.exp(sequence_log_ratio(new_logprobs.detach(), batch.logprobs, batch.response_mask)))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if plumbing.is_fsdp_unit(model):  # a DTensor: the norm over every rank's shards
                grad_norm = grad_norm.full_tensor()
            # never step on a non-finite gradient; every rank agrees before any of them steps
            plumbing.check_finite({"loss": torch.stack(losses), "gradient norm": grad_norm}, device)
            stats.setdefault("loss/policy_avg", []).append(torch.stack(losses).sum())  # the minibatch's loss
            grad_norms.append(grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    ratios = torch.cat(ratios)  # (num_ppo_epochs * k*B,) sequence-level ratios, whatever the loss's level
    out = {key: torch.stack(values).mean().item() for key, values in stats.items()}
    out["val/ratio"] = ratios.mean().item()
    out["val/ratio_var"] = ratios.var().item() if ratios.numel() > 1 else 0.0
    out["policy/grad_norm"] = torch.stack(grad_norms).mean().item()
    return out


def learning_rate_at(update: int, num_updates: int, args: Args) -> float:
    """Linear decay from learning_rate (update 1) towards 0, or constant."""
    if args.lr_scheduler_type == "constant":
        return args.learning_rate
    return args.learning_rate * (1.0 - (update - 1) / num_updates)


# ===================================================================== evaluation
EVAL_TEMPERATURE = 0.01  # near-greedy, as TRL's evaluation samples


@torch.no_grad()
def evaluate(
    policy, eval_dataset, sources: plumbing.RewardSources, tokenizer, args: Args, stop_token_id: Optional[int],
    dist_info: plumbing.Dist, autocast,
) -> dict[str, float]:
    """Mean score of near-greedy completions of up to eval_max_prompts test prompts, spread over the ranks."""
    indices = list(range(dist_info.rank, min(len(eval_dataset), args.eval_max_prompts), dist_info.world_size))
    total = torch.zeros(4, dtype=torch.float64, device=dist_info.device)  # score sum, length sum, stops, count
    chunk = min(plumbing.rows_per_forward(args, policy, "generation", dist_info.device, len(indices)),
                plumbing.rows_per_forward(args, sources.model, "scoring", dist_info.device, len(indices)))
    plumbing.note_phase("evaluation")
    with plumbing.reward_faults(dist_info.device, "evaluation", after_training=True):
        for start in range(0, len(indices), max(chunk, 1)):
            rows = eval_dataset[indices[start : start + chunk]]
            queries, query_mask = plumbing.pad_sequences(rows[plumbing.PROMPT_IDS], tokenizer.pad_token_id,
                                                         dist_info.device)  # (b, Tq)
            with autocast():
                completions = sample_completions(policy, queries, query_mask, args.response_length, EVAL_TEMPERATURE,
                                                 stop_token_id, tokenizer.pad_token_id)  # (b, Tq + Tr)
            scores, _ = score_completions(sources, completions, rows, args.prompt_column, tokenizer, stop_token_id,
                                          chunk, autocast)  # (b,)
            total += torch.tensor([scores.sum().item(), completions.response_mask.sum().item(),
                                   completions.ended(stop_token_id).sum().item(), len(scores)],
                                  dtype=torch.float64, device=dist_info.device)
    score_sum, length_sum, stops, count = plumbing.all_reduce(total).tolist()
    count = max(count, 1.0)
    return {"eval/scores": score_sum / count, "eval/mean_length": length_sum / count, "eval/eos_frac": stops / count}


def evaluation_updates(num_updates: int, num_evals: int) -> set[int]:
    """The updates after which the policy is evaluated: num_evals of them spread evenly over the run, the last at its
    end (num_evals 0: only the end). The initial policy's evaluation (update 0) comes on top."""
    return {math.ceil(i * num_updates / num_evals) for i in range(1, num_evals + 1)} if num_evals else {num_updates}


# ===================================================================== main
@dataclass
class PromptBatch:
    """B prompts drawn for one update, their k completions asked for and not yet trained on."""

    rows: dict  # the dataset's B rows: PROMPT_IDS, the prompt column, any column a reward function takes
    queries: torch.Tensor  # (B, Tq) left-padded to this batch's longest prompt
    query_mask: torch.Tensor  # (B, Tq)
    sampler_state: dict  # the sampler before drawing them: where a resume starts while the batch is in flight


def main(args: Args, make_rollouts: Callable = LocalRollouts) -> None:
    """Train: set up, then the six steps of each update. `make_rollouts(policy, args, stop_token_id, pad_token_id,
    generator, autocast)` gives the source of completions (LocalRollouts); rloo_multinode.py passes its engines'."""
    lock = plumbing.OutputDirLock(args.output_dir)  # one run per output_dir: taken by the Checkpointer below
    stop_signal = plumbing.StopSignal(lock, announce=os.environ.get("RANK", "0") == "0")  # until training:
    # a signal ends the run at once; from then on, after the update, with a checkpoint
    # ---- set-up: the cheap checks first, so that a typo fails before any weights load
    plumbing.validate_args(args)
    reward_functions = plumbing.load_reward_functions(args.reward_fn)
    plumbing.quiet_hub_progress_bars()
    dist_info = plumbing.setup_distributed(args.ddp_timeout)
    sizes = compute_batch_sizes(args, dist_info.world_size)
    device, master = dist_info.device, dist_info.master
    checkpoints = plumbing.Checkpointer(args, dist_info, lock)  # output_dir locked, the checkpoint to start from
    with checkpoints.refusal_leaves_nothing():
        plumbing.choose_kernels()
        autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=args.bf16)
        with plumbing.startup_step("loaded the tokenizer", master):
            tokenizer, vocab_size = plumbing.prepare_tokenizer(args)  # and the models' configs checked
        with plumbing.startup_step("loaded the prompts", master) as said:
            dataset, eval_dataset, dropped = plumbing.load_prompts(args, tokenizer, vocab_size,
                                                                      prompt_token_ids)
            said.append(f"{len(dataset)} train" + (f", {len(eval_dataset)} test" if eval_dataset else "")
                        + f"; {plumbing.describe_prompt_lengths(dropped, args.max_prompt_length)}")
        sampler = PromptSampler(len(dataset), sizes.prompts, dist_info.rank, dist_info.world_size, args.seed)
        plumbing.check_reward_function_arguments(reward_functions, [
            (args.dataset_name, dataset), (args.dataset_test_split, eval_dataset)], args.prompt_column)
        num_updates = math.ceil((args.total_episodes or int(args.num_train_epochs * len(dataset))) / sizes.all_ranks)
        checkpoints.check_continues(num_updates, sizes.all_ranks)
        reference = "" if args.kl_coef == 0 else " and its reference" + (" (adapters off)" if args.use_peft else "")
        with plumbing.startup_step(f"loaded the policy{reference}", master):
            policy, ref_policy, tokenizer, stop_token_id = load_policy(args, device, checkpoints.path, tokenizer)
        with plumbing.startup_step("loaded the reward model" if args.reward_model_path else "set up the reward "
                                   "functions", master):
            sources = plumbing.load_reward_sources(args, tokenizer, reward_functions, device)
        # each prompt computed once for its k completions, in every phase, where the model can take it exactly
        notes = []  # printed once the run starts
        with plumbing.startup_step("start-up check of prompt sharing (each prompt computed once for its k "
                                   "completions, checked against the plain path)", master):
            probe = Completions(**plumbing.sharing_probe(dataset[0][plumbing.PROMPT_IDS], args.max_prompt_length,
                                                         args.response_length, device))
            share_prompt = plumbing.shares_prompts(policy, "policy", args.share_prompt, probe, lambda c, share:
                                                   forward_logprobs(policy, c, 1.0, share)[0][c.response_mask], notes)
            with plumbing.visiting(sources.model, device):  # --offload: a frozen model's passes are on the GPU
                sources.share_prompt = sources.model is not None and sources.model_tokenizer is None and \
                    plumbing.shares_prompts(sources.model, "reward model", args.share_prompt, probe, lambda c, share:
                                            reward_model_scores(sources.model, c, share), notes)

        if args.fsdp:
            trained = plumbing.shard_policy(policy, args.bf16, args.offload)  # in place: policy is the sharded module
        elif dist.is_initialized():
            trained = DDP(policy, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            trained = policy  # the policy as training calls it; `policy` samples, scores log-probs and is saved
        trainable = [p for p in policy.parameters() if p.requires_grad]  # all, or with --use_peft the adapters
        optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_epsilon,
                                      fused=device.type == "cuda" and not args.offload)  # one kernel for all tensors
        plumbing.seed_everything(args.seed + dist_info.rank)  # from here on each rank samples differently
        sampling_rng = torch.Generator(device).manual_seed(args.seed + dist_info.rank)  # only sampling draws from it
        checkpoints.load(policy, optimizer, tokenizer, sampler, sampling_rng)  # a resumed run's state restored
        notes = (checkpoints.notes() if master else []) + notes  # output_dir settled for this run's timeline
        run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
        logger = plumbing.RunLogger(args, run_name, num_updates, checkpoints.start_update, checkpoints.wandb_run_id) \
            if master else None
        checkpoints.wandb_run_id = logger and logger.wandb_run_id  # saved with each checkpoint, for a resume
        if logger is not None:
            if args.use_peft:
                notes.append(f"LoRA: {sum(p.numel() for p in trainable):,} trainable parameters of "
                             f"{sum(p.numel() for p in policy.parameters()):,}; adapted modules "
                             f"{sorted(policy.peft_config['default'].target_modules)}")
            notes.append(f"{run_name}: {num_updates} updates x {sizes.all_ranks} completions ({sizes.prompts} prompts "
                         f"x k={args.rloo_k} per rank x {dist_info.world_size} ranks); {len(dataset)} train prompts "
                         f"({plumbing.describe_dropped(dropped, args.max_prompt_length)}); reward sources "
                         f"{sources.names}")
            for note in notes:
                logger.console.print(note, highlight=False, soft_wrap=True)
        rollouts = make_rollouts(policy, args, stop_token_id, tokenizer.pad_token_id, sampling_rng, autocast)
        timer = plumbing.PhaseTimer(device)
        timer.count_tokens_of(policy, ref_policy, sources.model, getattr(rollouts, "sampler", None))
    eval_at = evaluation_updates(num_updates, args.num_evals) if eval_dataset is not None else set()
    sample_every = max(1, num_updates // args.num_sample_generations) if args.num_sample_generations > 0 else 0
    queued: list[PromptBatch] = []  # drawn, sampled or being sampled, not yet trained on

    def data_position() -> dict:
        """The sampler before the oldest batch not yet trained on: where a resume draws again."""
        return queued[0].sampler_state if queued else sampler.state_dict()

    def evaluation(update: int, episode: int) -> None:
        policy.eval()
        with plumbing.gathered_for_rollout(policy, args.fsdp_generation), plumbing.visiting(sources.model, device):
            eval_metrics = evaluate(policy, eval_dataset, sources, tokenizer, args, stop_token_id, dist_info, autocast)
        if logger is not None:
            logger.log_eval(update, eval_metrics, episode)

    stop_signal.training = True
    try:
        update = checkpoints.start_update  # what a fault during the initial evaluation reports: nothing new
        if eval_at and update == 0:  # the initial policy: where the curves start (not again on resume)
            evaluation(0, 0)
        for update in range(checkpoints.start_update + 1, num_updates + 1):
            timer.start_update()
            update_start = time.perf_counter()
            update_position, update_rng = data_position(), plumbing.rng_state(sampling_rng)  # a reward fault's restart
            for group in optimizer.param_groups:
                group["lr"] = learning_rate_at(update, num_updates, args)

            # ALGO LOGIC 1-3. k completions of each of B prompts, then their log-probs under the sampling policy and
            # the reference. The rollout source may sample ahead (rollouts.lookahead batches: rloo_multinode.py's
            # --async_generation): the queue is topped up first, then the oldest batch is taken
            policy.eval()
            with plumbing.gathered_for_rollout(policy, args.fsdp_generation):
                while len(queued) <= min(rollouts.lookahead, num_updates - update):
                    sampler_state, rows = sampler.state_dict(), dataset[sampler.next_indices()]
                    queries, query_mask = plumbing.pad_sequences(rows[plumbing.PROMPT_IDS],
                                                                 tokenizer.pad_token_id, device)  # (B, Tq)
                    rollouts.submit(queries, query_mask)  # k completions each, returned in the (k, B) layout
                    queued.append(PromptBatch(rows, queries, query_mask, sampler_state))
                try:
                    with timer("generation"):
                        completions, rollout_metrics = rollouts.take()  # (B, Tq) queries, (k*B, Tr) responses
                except plumbing.RolloutSourceError as e:  # the last update's state is intact: keep it, then stop
                    path = checkpoints.save(update - 1, data_position())
                    raise plumbing.RolloutSourceError(f"{e}; checkpoint of update {update - 1} saved to {path}") \
                        from None
                batch = queued.pop(0)
                with rollouts.behaviour_policy(policy) as behaviour:
                    rollout = collect_rollout(behaviour, ref_policy, completions, args, share_prompt,
                                              logprobs_from_update(args, sizes, rollouts.lookahead), autocast,
                                              timer)  # (k*B, Tr) log-probs
            has_stop = rollout.ended(stop_token_id)  # (k*B,)

            # ALGO LOGIC 4. score every completion (reward model and reward functions), then the missing-EOS penalty
            with timer("scoring"):
                with plumbing.visiting(sources.model, device), \
                        plumbing.reward_faults(device, f"scoring of update {update}"):
                    chunk = plumbing.rows_per_forward(args, sources.model, "scoring", device, len(rollout.responses),
                                                      args.rloo_k)
                    raw_scores, source_means = score_completions(sources, rollout, batch.rows, args.prompt_column,
                                                                 tokenizer, stop_token_id, chunk, autocast)  # (k*B,)
                scores = apply_missing_eos_penalty(raw_scores, has_stop, args.missing_eos_penalty)  # (k*B,)
                if args.normalize_reward:
                    scores = whiten(scores).clamp(-args.reward_clip_range, args.reward_clip_range)

            # ALGO LOGIC 5-6. KL-penalized rewards and leave-one-out advantages (compute_advantages), then PPO epochs
            # of the clipped surrogate. On-policy, the update computes them from its own forward (logprobs_from_update)
            policy.train()  # dropout is off; train mode only switches gradient checkpointing on
            with timer("training"), plumbing.batch_kept_if_nonfinite(args.output_dir, update, dist_info.rank,
                                                                     tokenizer, rollout, raw_scores):
                plumbing.check_finite({"reward": raw_scores, "log-prob": rollout.logprobs,
                                       "reference log-prob": rollout.ref_logprobs}, device)  # on every rank at once
                train_stats = ppo_update(trained, optimizer, rollout, scores, args, sizes, share_prompt, autocast)
            rollout_metrics.update(rollouts.policy_updated(update, policy))  # rloo_multinode.py: the engines' sync

            # log (this rank's metrics under TRL's names, then reduced over ranks), evaluate, save
            kl = kl_to_reference(rollout) * rollout.response_mask  # (k*B, Tr)
            metrics = {
                "objective/kl": kl.sum(1).mean().item(),
                "objective/entropy": (-rollout.logprobs * rollout.response_mask).sum(1).mean().item(),
                "objective/non_score_reward": (-args.kl_coef * kl.sum(1)).mean().item(),
                "objective/rlhf_reward": rollout.rlhf_reward.mean().item(),
                "objective/scores": scores.mean().item(),
                "objective/raw_scores": raw_scores.mean().item(),
                **train_stats,  # policy/*, loss/policy_avg, val/ratio*
                **plumbing.completion_metrics(rollout.response_mask, has_stop, scores, args.rloo_k),
                **({} if rollout.sampler_logprobs is None else
                   plumbing.mismatch_metrics(rollout, args, importance_weights)),
                **source_means, **rollout_metrics, **timer.metrics(),
                "work/minimum_tokens": plumbing.minimum_forward_tokens(rollout, sum(
                    args.num_ppo_epochs if phase == "training" else 1 for phase in timer.tokens)),
                "time/update": time.perf_counter() - update_start,  # all of the update but evaluation and saving
            }
            episode = update * sizes.all_ranks
            metrics = plumbing.reduce_metrics(metrics, device, rollouts.max_metrics)
            metrics.update(eps=episode / (time.time() - checkpoints.start_time), lr=optimizer.param_groups[0]["lr"],
                           episode=episode)
            if logger is not None:
                logger.log(update, metrics)
                if sample_every and (update - 1) % sample_every == 0:  # the first sample of the first prompts
                    logger.sample_table([(tokenizer.decode(batch.queries[i][batch.query_mask[i]]),
                                          tokenizer.decode(rollout.responses[i][rollout.response_mask[i]]),
                                          scores[i].item()) for i in range(min(5, sizes.prompts))], episode)
            if update in eval_at:
                evaluation(update, episode)
            stop = stop_signal.requested(device)  # on every rank as soon as any rank got a signal
            if stop or update == num_updates or (args.save_steps > 0 and update % args.save_steps == 0):
                checkpoints.save(update, data_position())
            if stop:
                checkpoints.stopped(logger, f"{stop_signal.name or 'a signal to another rank'} received: stopped "
                                            f"after update {update}")
                break
        else:  # the final policy, its tokenizer and args.json: their presence in output_dir marks a finished run
            checkpoints.save_final(policy, num_updates)
            if args.merge_lora and master:
                plumbing.save_merged_policy(args, policy.config, tokenizer)
            if logger is not None:
                checkpoints.mark_finished()
                logger.console.print(f"saved the policy and tokenizer to {args.output_dir}")
    except plumbing.RewardFunctionError as e:  # every rank at once: keep the last finished update, then stop
        where = checkpoints.keep(update, data_position()) if e.after_training else \
            checkpoints.keep(update - 1, update_position, update_rng)
        if e.signal_name is None:
            raise plumbing.RewardFunctionError(f"{e}; {where}", e.announce) from None
        checkpoints.stopped(logger, f"{e.signal_name} received while a reward function ran: stopped at once")
    except plumbing.MetricsWriteError as e:  # rank 0's alone: a checkpoint needs every rank
        where = "no checkpoint: it needs every rank (torchrun stops the others)" if dist.is_initialized() else \
            checkpoints.keep(update, data_position())
        raise plumbing.MetricsWriteError(f"{e} after update {update}; {where}") from None
    finally:  # an error on one rank alone must not wait for the others: torchrun stops them
        rollouts.close()
        if logger is not None:
            logger.close()
    plumbing.barrier("the end of the run")
    del trained  # DDP's reducer must not be what frees the process group (plumbing.end_distributed)
    plumbing.end_distributed()


# ===================================================================== command line
def cli() -> None:
    plumbing.run_script(main, plumbing.parse_args(Args, prog="rloo.py"), "rloo.py")


if __name__ == "__main__":
    cli()
