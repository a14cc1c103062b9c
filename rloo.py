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

Shapes (every symbol of a `# (..)` comment): B prompts per rank and update; k = rloo_k completions each; k*B
completions, in the (k, B) layout (row j*B + i is sample j of prompt i); N the completions of whatever batch a function
gets (a micro-batch, a chunk); g prompt groups in a chunk or micro-batch (their k*g completions in the (k, g) layout);
Tq the batch's longest prompt (left-padded), Tr its longest response (right-padded, at most response_length), T a
sequence's; Tr' a micro-batch's longest response; V the vocabulary; H the hidden size; L the length of a grouped row (a
prompt, then its k responses back to back), P the positions whose logits it computes; n the real (unpadded) tokens of a
batch; S reward sources; .. any leading dimensions.

Sections, in the order a run needs them (docs/algorithm.md maps each): Args (the algorithm's flags) and
AlgorithmState (what it carries across updates), batch arithmetic, models, rollout (1-3), rewards (4), advantages
(5), loss and update (6), evaluation, main. What nobody changes when changing the algorithm (the run's flags, data,
checkpoints, faults, signals, measuring, logging, file loading, kernels, the shortcuts' start-up checks, the command
line) is in plumbing/, called as plumbing.X: copying this file means copying that folder with it.
"""

import contextlib
import copy
import functools
import math
import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, ClassVar, Literal, Optional, Protocol

import plumbing  # first, before torch loads: OMP_WAIT_POLICY, and Ctrl-C while importing (plumbing/startup.py)
import torch
import torch.distributed as dist


@dataclass
class Args(plumbing.RunArgs):
    """The algorithm's flags; plumbing.RunArgs adds the run's (models, data, output_dir, checkpoints, memory and speed,
    LoRA, logging)."""

    resumable_changes: ClassVar[frozenset] = plumbing.RunArgs.resumable_changes | {
        "num_generations_eval", "log_completions", "num_completions_to_print"}  # evaluation and printing only

    # ----- RLOO -----
    rloo_k: int = 2
    """completions sampled per prompt (k >= 2: the baseline of each is the mean of the other k-1)"""
    kl_coef: float = 0.05
    """weight of the KL penalty to the reference policy; 0 skips the reference model entirely"""
    token_level_kl: bool = False
    """per-token KL penalties with token-level returns (each token's advantage sees the KL of the tokens
    after it) instead of one sequence-level penalty; the loss then uses per-token ratios"""
    kl_in_loss: bool = False
    """GRPO's placement: the KL to the reference is a term of the loss (kl_coef x its estimate, k3 by default,
    summed over each completion's tokens), not a penalty of the reward"""
    kl_estimator: Optional[Literal["k1", "k2", "k3"]] = None
    """Schulman's per-token estimator of the KL in the reward (or with --kl_in_loss the loss), r = logref - logp:
    k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1; None: k1 in the reward (TRL's RLOO), k3 in the loss (GRPO's)"""
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of completions that never emit the stop token ("EOS trick")"""
    normalize_reward: bool = False
    """standardize scores over the global batch, then clip them to +-reward_clip_range"""
    reward_clip_range: float = 10.0
    """clip range of the normalized scores"""
    normalize_advantage: bool = False
    """whiten advantages over the global batch"""
    cliprange: float = 0.2
    """PPO clip range of the sequence-level ratio: clipped to [1 - cliprange, 1 + cliprange] (TRL: epsilon)"""
    epsilon_high: Optional[float] = None
    """upper clip range (clip-higher, DAPO): the ratio is clipped to [1 - cliprange, 1 + epsilon_high];
    None: cliprange"""
    mask_truncated_completions: bool = False
    """completions that never emit the stop token leave the loss (their loss terms are 0; the loss is still divided
    by every completion) and their KL leaves their reward, which stays in their groups' baselines (TRL's)"""
    sync_ref_model: bool = False
    """TR-DPO: every ref_model_sync_steps optimizer steps the reference becomes
    ref_model_mixup_alpha x policy + (1 - ref_model_mixup_alpha) x reference (its weights go into checkpoints)"""
    ref_model_mixup_alpha: float = 0.6
    """the policy's share of the reference after a --sync_ref_model mix"""
    ref_model_sync_steps: int = 512
    """optimizer steps (counted over the run) between two --sync_ref_model mixes"""
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
    """sampling temperature; logits are divided by it when log-probs are computed"""
    top_k: int = 0
    """sample only from the top_k most likely tokens (ties at the k-th kept); 0 keeps all. The log-probs trained on
    (ratio, KL, mismatch) are of the distribution sampled from (sampling_logits)"""
    top_p: float = 1.0
    """nucleus sampling: only the fewest most likely tokens whose probabilities (after temperature and top_k) sum to
    at least top_p; 1 keeps all"""
    min_p: Optional[float] = None
    """drop the tokens whose probability is below min_p x the most likely token's (after top_p); None keeps all"""
    repetition_penalty: float = 1.0
    """divide the logit of every token already in the prompt or the response so far by this when positive (multiply
    when negative), before the temperature (transformers' and vLLM's meaning); 1 is none"""
    generation_batch_size: Optional[int] = None
    """completions sampled per update, all ranks together (TRL's): sets num_mini_batches to it / (micro-batch x
    gradient_accumulation_steps x ranks); None: per_device_train_batch_size x gradient_accumulation_steps x
    num_mini_batches x ranks"""
    num_generations_eval: Optional[int] = None
    """near-greedy completions per test prompt at evaluation (the scores averaged over all); None is 1 (TRL's None is
    num_generations, sampled at the training temperature)"""
    log_completions: bool = False
    """print (and log to wandb) the table of prompt / completion / score at every update, not only
    num_sample_generations times"""
    num_completions_to_print: Optional[int] = None
    """rows of that table: each prompt's k completions together, rank 0's; None: 5 prompts' first completion, or with
    --log_completions all of rank 0's completions"""
    stop_token: Optional[Literal["eos"]] = "eos"
    """truncate completions after the first EOS; None keeps all response_length tokens"""
    stop_token_id: Optional[int] = None
    """truncate after this token id instead (overrides --stop_token)"""

    # ----- optimization -----
    total_episodes: Optional[int] = None
    """completions to train on, all ranks together; None is num_train_epochs x the prompts x rloo_k"""
    max_steps: Optional[int] = None
    """optimizer steps of the run (TRL's Trainer), a multiple of num_ppo_epochs x num_mini_batches (an update's);
    replaces --total_episodes; --save_steps and --logging_steps then count optimizer steps too, as TRL's do"""
    num_train_epochs: float = 1.0
    """passes over the prompts, each prompt sampled rloo_k times (TRL 1.16's epoch; TRL <= 0.21's was 1/rloo_k of
    it); used only without --total_episodes and --max_steps"""
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
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """linear or cosine decay to 0 over the run (after the warmup), or constant (constant_with_warmup: the same, TRL's
    name for it with a warmup; with --trl_defaults 1.16 transformers' schedules, stepped every optimizer step)"""
    warmup_ratio: float = 0.0
    """share of the updates over which the learning rate rises linearly from learning_rate / warmup updates to
    learning_rate, then decays or stays (--trl_defaults 1.16: of the optimizer steps, from 0, as transformers')"""
    warmup_steps: float = 0
    """the warmup in scheduler steps (updates; --trl_defaults 1.16: optimizer steps), or below 1 a share of them
    (transformers 5's meaning; --warmup_ratio is transformers 4's)"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on every trained weight but biases and norms (TRL's default and meaning)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this (<= 0: no clipping, the norm is still logged)"""

    @property
    def cliprange_high(self) -> float:
        """the upper clip range the loss and the metrics use: --epsilon_high, or --cliprange"""
        return self.cliprange if self.epsilon_high is None else self.epsilon_high

    def check_algorithm(self) -> None:
        """Called by plumbing.validate_args beside the run's checks: algorithm_checks."""
        algorithm_checks(self)


@dataclass
class AlgorithmState(plumbing.UpdateState):
    """What the algorithm carries from one update to the next (a controller's coefficient, a running statistic); Args
    never changes during a run. Made by start once the prompts are loaded, read anywhere (ppo_update hands it to
    compute_advantages and policy_loss), changed only in after_update (elsewhere refused, naming the field). Each rank
    saves its own, finite; a resume restores it bit for bit, type-checked: plain values and tensors (back on the CPU).
    Stock RLOO keeps none; docs/algorithm.md has worked examples."""

    @classmethod
    def start(cls, args: Args, num_prompts: int) -> "AlgorithmState":  # num_prompts: the training split's
        return cls()

    def after_update(self, args: Args, rollout: "Rollout", raw_scores: torch.Tensor, trained_on: "Advantages",
                     metrics: dict[str, float]) -> dict[str, float]:
        """main's call on every rank once per update, after training: this rank's k*B completions (rows of the split:
        rollout.prompt_index), raw_scores (k*B,) as scored, the Advantages trained on, the update's metrics reduced
        over ranks (every rank's alike). Returns metrics of its own, logged as rank 0 holds them."""
        return {}


def algorithm_rules(a: Args) -> list[tuple[str, object, bool, str]]:
    """(flag, value, whether it is allowed, what it must be) for every algorithm number a typo or a NaN makes
    meaningless, or the first updates non-finite: sampling at temperature 1e-40 or inf, a clip range of 0, a negative
    learning rate, a KL coefficient beyond plumbing.SCALE_LIMIT. The run's numbers: plumbing.flags.number_rules."""
    finite = plumbing.is_finite_number

    def each(requirement: str, allowed: Callable[[object], bool], *names: str) -> list:  # one rule, several flags
        return [(name, getattr(a, name), allowed(getattr(a, name)), requirement) for name in names]

    within = functools.partial(plumbing.within, a)  # a flag in [low, high], a scale within plumbing.SCALE_LIMIT
    return [
        *each("a finite number > 0", lambda x: finite(x) and x > 0, "cliprange", "vllm_importance_sampling_cap",
              "adam_epsilon", "reward_clip_range", "num_train_epochs"), within("kl_coef", 0),
        within("vllm_importance_sampling_cap", 0), within("learning_rate", 0, 1, "AdamW's step size per weight"),
        within("temperature", 0.01, None, "vLLM's floor: logits are divided by it; below, log-probs overflow float32"),
        within("weight_decay", 0, 1 / max(a.learning_rate, 1e-300), "1 / --learning_rate: AdamW multiplies a weight by "
               "1 - their product"),
        *each("at least 1, or None", lambda x: x is None or x >= 1, "generation_batch_size", "num_generations_eval",
              "num_completions_to_print"),
        ("epsilon_high", a.epsilon_high, a.epsilon_high is None or (finite(a.epsilon_high) and a.epsilon_high > 0),
         "a finite number > 0, or None (then --cliprange)"),
        ("max_grad_norm", a.max_grad_norm, not math.isnan(a.max_grad_norm), "a number (<= 0: no clipping)"),
        ("missing_eos_penalty", a.missing_eos_penalty, a.missing_eos_penalty is None or abs(a.missing_eos_penalty) <=
         plumbing.SCALE_LIMIT, f"None or at most {plumbing.SCALE_LIMIT:g} in magnitude (beyond, gradients overflow)"),
        ("total_episodes", a.total_episodes, a.total_episodes is None or a.total_episodes >= 1, ">= 1, or None"),
        ("max_steps", a.max_steps, a.max_steps is None or a.max_steps >= 1, ">= 1, or None (then --total_episodes)"),
        ("warmup_ratio", a.warmup_ratio, finite(a.warmup_ratio) and 0 <= a.warmup_ratio <= 1 and not (
            a.warmup_ratio and a.warmup_steps), "in [0, 1], without --warmup_steps (both set the warmup: pass one)"),
        ("warmup_steps", a.warmup_steps, plumbing.is_interval(a.warmup_steps) or a.warmup_steps == 0,
         "a whole number of steps >= 0, or a share of them in (0, 1)"), within("ref_model_mixup_alpha", 0, 1),
        ("stop_token_id", a.stop_token_id, a.stop_token_id is None or a.stop_token_id >= 0, "a token id >= 0 or None"),
        *each("at least 1", lambda x: x >= 1, "response_length", "ref_model_sync_steps"),
        ("top_p", a.top_p, finite(a.top_p) and 0 < a.top_p <= 1, "in (0, 1] (1: no nucleus filter)"),
        ("top_k", a.top_k, a.top_k >= 0, ">= 0 (0: no top-k filter)"),
        ("min_p", a.min_p, a.min_p is None or (finite(a.min_p) and 0 <= a.min_p <= 1), "in [0, 1], or None"),
        within("repetition_penalty", 0.01, 100, "1: none; it divides logits, as the temperature does"),
    ]


def algorithm_checks(args: Args) -> None:
    """The algorithm's flags: each number within its rules (algorithm_rules), then the flags that clash."""
    for name, value, allowed, requirement in algorithm_rules(args):
        if not allowed:
            raise plumbing.ConfigError(f"{name} = {value!r} must be {requirement}")
    stops = args.stop_token is not None or args.stop_token_id is not None
    if args.missing_eos_penalty is not None and not stops:
        raise plumbing.ConfigError("--missing_eos_penalty needs a stop token: pass --stop_token eos or "
                                   "--stop_token_id ID")
    if args.mask_truncated_completions and not stops:
        raise plumbing.ConfigError("--mask_truncated_completions drops completions without a stop token from the "
                                   "loss, but none is set: pass --stop_token eos or --stop_token_id ID")
    if args.kl_in_loss and args.kl_coef == 0:
        raise plumbing.ConfigError("--kl_in_loss puts the KL to the reference in the loss, but with kl_coef 0 there is "
                                   "no reference: set --kl_coef (the KL term's weight) or drop --kl_in_loss")
    if args.vllm_importance_sampling_mode.startswith("token") and not args.token_level_kl:
        raise plumbing.ConfigError(f"--vllm_importance_sampling_mode {args.vllm_importance_sampling_mode} weights "
                                   "tokens, but the sequence-level loss has one action per completion: add "
                                   "--token_level_kl or pass a sequence_ mode")
    if args.max_steps is not None and args.total_episodes is not None:
        raise plumbing.ConfigError(f"--max_steps {args.max_steps} and --total_episodes {args.total_episodes} both "
                                   "set the run's length: pass one of them")
    if args.sync_ref_model:
        if args.kl_coef == 0:
            raise plumbing.ConfigError("--sync_ref_model mixes the policy into the reference, but with kl_coef 0 there "
                                       "is no reference: drop --sync_ref_model or set --kl_coef")
        if args.use_peft:
            raise plumbing.ConfigError("--sync_ref_model with --use_peft: the reference is the policy's own base with "
                                       "the adapters off (no second copy), and mixing the policy into it would change "
                                       "the base the adapters train on; drop one of them")
        if args.fsdp:
            raise plumbing.ConfigError("--sync_ref_model with --fsdp is not supported: the policy is sharded and the "
                                       "reference replicated, and the mix would gather every weight; drop one of them")


# ===================================================================== batch arithmetic
@dataclass(frozen=True)
class BatchSizes:
    micro: int  # completions per forward/backward pass, per rank
    mini: int  # completions per optimizer step, per rank = micro * gradient_accumulation_steps
    local: int  # completions per update, per rank = mini * minibatches = k * prompts
    minibatches: int  # optimizer steps per PPO epoch: num_mini_batches, or from --generation_batch_size
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
    minibatches = args.num_mini_batches
    if args.generation_batch_size is not None:  # TRL's: completions per generation, which spans minibatches steps
        per_step = mini * world_size
        minibatches = args.generation_batch_size // per_step
        if args.generation_batch_size % per_step or args.num_mini_batches not in (1, minibatches):
            raise plumbing.ConfigError(
                f"--generation_batch_size {args.generation_batch_size} must be a multiple of the completions of one "
                f"optimizer step, per_device_train_batch_size ({micro}) x gradient_accumulation_steps "
                f"({args.gradient_accumulation_steps}) x {world_size} ranks = {per_step}, and sets num_mini_batches to "
                f"the quotient: pass a multiple, and not --num_mini_batches {args.num_mini_batches} with it")
    local = mini * minibatches
    if local % args.rloo_k:
        raise plumbing.ConfigError(f"per_device_train_batch_size ({micro}) x gradient_accumulation_steps "
                                   f"({args.gradient_accumulation_steps}) x num_mini_batches ({minibatches})"
                                   f" = {local} completions per rank is not divisible by rloo_k ({args.rloo_k}); make "
                                   "the product a multiple of rloo_k")
    return BatchSizes(micro=micro, mini=mini, local=local, prompts=local // args.rloo_k,
                      all_ranks=local * world_size, minibatches=minibatches)


# ===================================================================== models
def load_policy(args: Args, device: torch.device, checkpoint: Optional[Path] = None, tokenizer=None):
    """The policy (fp32 master weights, or with --use_peft LoRA adapters on the base; from the checkpoint when
    resuming), its frozen reference, always the initial policy (None when kl_coef = 0; with LoRA, AdaptersOff), the
    tokenizer with a pad token, and the stop token id."""
    tokenizer_path = args.model_name_or_path or args.sft_model_path
    initial_path = args.sft_model_path or args.model_name_or_path
    if tokenizer is None:
        tokenizer, _ = plumbing.prepare_tokenizer(args)
    policy = plumbing.load_causal_lm(initial_path, torch.float32, args.trust_remote_code, None if args.use_peft else
                                     checkpoint, **plumbing.policy_options(args))  # LoRA: the base, never trained
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
        frozen_dtype = torch.bfloat16 if args.bf16 else torch.float32  # loaded on resume: its own dtype, not fp32
        ref_policy = copy.deepcopy(policy) if checkpoint is None else \
            plumbing.load_causal_lm(initial_path, frozen_dtype, args.trust_remote_code, **plumbing.policy_options(args))
        plumbing.disable_dropout(ref_policy)
        ref_policy.to(frozen_home, frozen_dtype).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy, ref_policy, tokenizer, stop_token_id


# ===================================================================== rollout
def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, T) positions counting real tokens only, so left padding does not shift them."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


@dataclass(frozen=True)
class SamplingFilters:
    """What the distribution sampled from is, beyond the temperature (--top_k, --top_p, --min_p,
    --repetition_penalty); the default changes nothing."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0

    @property
    def cuts(self) -> bool:  # whether a filter may take tokens out of the support: one is off its default, and not 0
        return any(getattr(self, f.name) not in (f.default, 0) for f in fields(self) if f.name != "repetition_penalty")

    @classmethod
    def of(cls, args) -> "SamplingFilters":  # from the Args fields of the same names
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})

    @property
    def neutral(self) -> bool:
        return not self.cuts and self.repetition_penalty == 1.0

    @property
    def reads_history(self) -> bool:
        """Whether a token's distribution depends on the tokens before it beyond the model (the repetition penalty)."""
        return self.repetition_penalty != 1.0


NO_FILTERS = SamplingFilters()


@dataclass(frozen=True)
class SamplingSettings:
    """What samples a batch, chosen per batch in main and carried by its Completions to every log-prob of it (on every
    RolloutSource): softmax(sampling_logits / temperature) with `filters`, max_new_tokens a completion (its Tr)."""

    temperature: float = 1.0
    filters: SamplingFilters = NO_FILTERS
    max_new_tokens: Optional[int] = None  # None: a batch made by hand, as wide as its responses

    @classmethod
    def of(cls, args) -> "SamplingSettings":  # the flags': --temperature, the filters' flags, --response_length
        return cls(args.temperature, SamplingFilters.of(args), args.response_length)


def sampling_logits(logits: torch.Tensor, temperature: float, filters: SamplingFilters,
                    seen: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The logits (.., V) of the distribution sampled from, at the model's scale (the caller divides by the
    temperature): the sampler draws from them (generate) and the trainer's forward takes its log-probs of them
    (forward_logprobs), so the two cannot differ. transformers' order, as TRL samples without vLLM: the repetition
    penalty on the raw logits of the tokens in `seen` (.., V bool: the prompt's real tokens and the response's earlier
    ones), then top-k, top-p (over what top-k kept) and min-p on softmax(logits / temperature). A filtered token gets
    the lowest finite float, not -inf: its probability is exactly 0 all the same, and an entropy E_p[x] stays finite
    (0 x -inf is NaN). `keep` (..,) token ids stay in the support whatever the filters say: the trainer passes the
    drawn tokens, whose own forward may place them a rounding error outside the nucleus the sampler's forward drew
    them from (their log-prob would be -inf, the ratio inf). The logits themselves when the filters are neutral;
    float32 otherwise. Temperature 0 (greedy): the penalty only, the filters keep the argmax."""
    if filters.neutral:
        return logits
    x = logits.float()  # (.., V), differentiable
    if filters.reads_history:
        penalty = filters.repetition_penalty
        x = torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
    if temperature <= 0 or not filters.cuts:
        return x
    with torch.no_grad():  # which tokens stay: a constant of the loss
        scaled = x / temperature  # (.., V)
        support = torch.ones_like(scaled, dtype=torch.bool)
        if 0 < filters.top_k < scaled.shape[-1]:  # ties with the k-th value stay, as transformers' and vLLM's do
            support = scaled >= scaled.topk(filters.top_k, dim=-1).values[..., -1:]
        if filters.top_p < 1.0:  # ascending: drop the tokens whose cumulative mass stays within 1 - top_p
            ascending, order = scaled.masked_fill(~support, -math.inf).sort(-1)
            dropped = ascending.softmax(-1).cumsum(-1) <= 1.0 - filters.top_p  # (.., V)
            dropped[..., -1] = False  # the most likely token always stays
            support &= ~dropped.scatter(-1, order, dropped)
        if filters.min_p:
            probs = scaled.masked_fill(~support, -math.inf).softmax(-1)  # (.., V)
            support &= probs >= filters.min_p * probs.amax(-1, keepdim=True)  # the most likely token stays
        if keep is not None:
            support.scatter_(-1, keep.unsqueeze(-1), True)
    return x.masked_fill(~support, torch.finfo(x.dtype).min)


def prompt_tokens_seen(queries: torch.Tensor, query_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(g, V) bool: the token ids among each (g, Tq) query's real tokens (the repetition penalty's start)."""
    seen = torch.zeros(queries.shape[0], vocab_size, dtype=torch.bool, device=queries.device)
    prompt, position = query_mask.nonzero(as_tuple=True)  # (n,) each, the real prompt tokens
    seen[prompt, queries[prompt, position]] = True
    return seen


def first_seen(c: "Completions", vocab_size: int) -> torch.Tensor:
    """(k*g, V) int32: the response position where each token id first occurs in each completion (-1: in its prompt;
    Tr: nowhere), so that token v is among the tokens before response position t exactly when first_seen < t."""
    n, width = c.responses.shape
    first = torch.full((n, vocab_size), width, dtype=torch.int32, device=c.responses.device)
    positions = torch.arange(width, dtype=torch.int32, device=first.device).expand(n, width)  # (k*g, Tr)
    first.scatter_reduce_(1, c.responses.masked_fill(~c.response_mask, 0),
                          positions.masked_fill(~c.response_mask, width), "amin")
    prompt = prompt_tokens_seen(c.queries, c.query_mask, vocab_size)  # (g, V)
    return first.masked_fill(prompt[torch.arange(c.queries.shape[0], device=first.device).repeat(c.k)], -1)


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
    filters: SamplingFilters = NO_FILTERS,
) -> torch.Tensor:
    """Sample k continuations of each of the g left-padded queries (g, Tq): (k*g, max_new_tokens) tokens in the
    (k, g) layout, row j*g + i continuing query i, from softmax(sampling_logits / temperature) (temperature 0:
    greedy). Each query is prefilled once, its cache copied to its k rows: preallocated (a `decoder`'s: its compiled
    step), or for state-space and recurrent layers the prefill's own. A row is padded after its stop token.
    `logprobs_out` (k*g, max_new_tokens), if given, receives the sampler's log-prob of each drawn token:
    log_softmax(sampling_logits / temperature), as the trainer computes it."""
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
    # (k*g, V) the tokens so far of each row, for the repetition penalty: its prompt's, then each drawn one
    seen = prompt_tokens_seen(queries, query_mask, logits.shape[-1])[prompt_of_row] if filters.reads_history else None
    for t in range(max_new_tokens):
        logits = sampling_logits(logits, temperature, filters, seen)  # (k*g, V) the distribution sampled from
        token = sample_tokens(logits, temperature, generator) if temperature > 0 else logits.argmax(-1)  # (k*g,)
        token = torch.where(done, pad_token_id, token)
        tokens[:, t] = token
        if seen is not None:
            seen[torch.arange(k * g, device=seen.device), token] = True
        if logprobs_out is not None:  # what the sampler gave the token it drew: for the mismatch metrics (k*g,)
            scaled = logits / temperature  # (k*g, V)
            logprob = scaled.gather(1, token[:, None])[:, 0] - scaled.logsumexp(-1)
            logprobs_out[:, t] = logprob.masked_fill(done, 0.0)  # a finished row's padding may be filtered out
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
    # what sampled the batch, which every log-prob of it is of (collect_rollout, ppo_update, the mismatch metrics):
    # softmax(sampling_logits / temperature); a batch made by hand is of softmax(logits)
    sampling: SamplingSettings = field(default=SamplingSettings(), kw_only=True)
    # (B,) each prompt's row in the training split, main's draw (its identity, for state kept per prompt); by hand: None
    prompt_index: Optional[torch.Tensor] = field(default=None, kw_only=True)

    PER_PROMPT: ClassVar[tuple[str, ...]] = ("queries", "query_mask", "prompt_index")  # the others: per completion

    @property
    def k(self) -> int:
        return self.responses.shape[0] // self.queries.shape[0]

    def ended(self, stop_token_id: Optional[int]) -> torch.Tensor:
        """(k*B,) bool: the completion emitted the stop token."""
        if stop_token_id is None:
            return torch.zeros(self.responses.shape[0], dtype=torch.bool, device=self.responses.device)
        return ((self.responses == stop_token_id) & self.response_mask).any(1)

    def map_tensors(self, per_prompt: Callable, per_completion: Callable) -> "Completions":
        """A copy (of the same class) with per_prompt(t) of each per-prompt tensor, per_completion(t) of the other
        tensors; the other fields as they are."""
        return replace(self, **{f.name: (per_prompt if f.name in self.PER_PROMPT else per_completion)(value)
                                for f in fields(self) if torch.is_tensor(value := getattr(self, f.name))})

    def of_prompts(self, prompts: torch.Tensor) -> "Completions":
        """The completions of g of the prompts (B indices), (k, g) layout, cut to their own widths: the longest of
        their prompts and of their responses (the padding columns all of them share are dropped)."""
        rows = completion_rows(prompts, self.queries.shape[0], self.k)  # (k*g,)
        prompt_width = int(self.query_mask[prompts].sum(1).max())
        response_width = int(self.response_mask[rows].sum(1).max())
        return self.map_tensors(lambda t: t[prompts, -prompt_width:] if t.dim() == 2 else t[prompts],
                                lambda t: t[rows, :response_width] if t.dim() == 2 else t[rows])  # (k*g, ..)

    def one_per_row(self, rows: torch.Tensor) -> "Completions":
        """Completions `rows` (indices into k*B) as k = 1 completions, each with its own copy of its prompt (for
        micro-batches that split prompt groups), cut to their own widths."""
        prompts = rows % self.queries.shape[0]  # (N,)
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


def tokens_before(c: Completions, vocab_size: int, grouped: Optional[GroupedRows] = None) -> torch.Tensor:
    """Bool (k*g, Tr, V), or (g, P, V) in `grouped`'s layout: the token ids before each predicted response token, its
    prompt's real tokens and its own response's earlier ones (what the repetition penalty reads). In a grouped row
    the k responses of a prompt follow one another but none sees another's tokens, so each predictor looks up its own
    completion's."""
    first = first_seen(c, vocab_size)  # (k*g, V)
    t = torch.arange(c.responses.shape[1], dtype=torch.int32, device=first.device)  # (Tr,)
    if grouped is None:
        return first[:, None, :] < t[None, :, None]  # (k*g, Tr, V)
    owner = torch.zeros(grouped.targets.shape, dtype=torch.long, device=first.device)  # (g, P) the completion predicted
    position = torch.zeros(grouped.targets.shape, dtype=torch.int32, device=first.device)  # (g, P) at this position
    completion, token = c.response_mask.nonzero(as_tuple=True)  # (n,) each, the real response tokens
    group = completion % c.queries.shape[0]  # (n,) completion j*g + i is in row i
    owner[group, grouped.slots[completion, token]] = completion
    position[group, grouped.slots[completion, token]] = t[token]
    return first[owner] < position[..., None]  # (g, P, V); predictors of no token: unread


def forward_logprobs(
    model, c: Completions, temperature: float, share_prompt: bool, with_entropy: bool = False,
    filters: SamplingFilters = NO_FILTERS,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (k*g, Tr) of the response tokens under sampling_logits / temperature (the logits / temperature when
    `filters` are neutral, as the reference's are) and, if asked, the entropy (k*g, Tr) of each token's distribution
    (differentiable, as an entropy bonus needs: policy/entropy_avg, not objective/entropy, which sums the sampled
    tokens' -log-probs). Logits are computed only where a response token is predicted (plumbing.logits_at); padding
    positions hold values that must be masked."""
    if not share_prompt:  # position Tq - 1 + t predicts response token t
        positions = c.queries.shape[1] - 1 + torch.arange(c.responses.shape[1], device=c.responses.device)  # (Tr,)
        logits = plumbing.logits_at(model, positions, **unshared_inputs(c))  # (k*g, Tr, V)
        seen = tokens_before(c, logits.shape[-1]) if filters.reads_history else None  # (k*g, Tr, V)
        # the drawn tokens stay in their own support (keep): a filter's edge may differ by a rounding error here
        logits = sampling_logits(logits, temperature, filters, seen, keep=c.responses)
        # log softmax(logits / T)[response token] and the entropy of softmax(logits / T), both differentiable
        return plumbing.SelectiveLogSoftmax.apply(logits, c.responses, temperature, with_entropy)
    grouped = grouped_rows_for(model, c)
    logits = plumbing.logits_at(model, grouped.predictors, **grouped.model_inputs())  # (g, P, V)
    seen = tokens_before(c, logits.shape[-1], grouped) if filters.reads_history else None  # (g, P, V)
    logits = sampling_logits(logits, temperature, filters, seen, keep=grouped.targets)  # the drawn tokens stay
    # log softmax(logits / T)[target] and the entropy of softmax(logits / T), in the logits' own layout, so that only
    # the (g, P) results are rearranged, never the (.., V) logits
    logprobs, entropy = plumbing.SelectiveLogSoftmax.apply(logits, grouped.targets, temperature,
                                                           with_entropy)  # (g, P) each
    group = torch.arange(c.queries.shape[0], device=logits.device).repeat(c.k)[:, None]  # (k*g, 1)
    return logprobs[group, grouped.slots], None if entropy is None else entropy[group, grouped.slots]


@dataclass
class Rollout(Completions):
    """One rank's completions of one update, k*B rows in the (k, B) layout, with their log-probs."""

    logprobs: Optional[torch.Tensor]  # (k*B, Tr) under the policy that sampled, by a forward pass (0 on padding);
    # None until the update's own forward fills them, when that is the same forward (on-policy: logprobs_from_update)
    ref_logprobs: Optional[torch.Tensor]  # (k*B, Tr) reference log-probs (0 on padding); None if kl_coef = 0
    # (k*B,) bool: the completions whose loss counts (--mask_truncated_completions: those that stopped); None: all
    in_loss: Optional[torch.Tensor] = field(default=None, kw_only=True)


@torch.no_grad()
def sample_completions(
    policy, queries: torch.Tensor, query_mask: torch.Tensor, response_length: int, temperature: float,
    stop_token_id: Optional[int], pad_token_id: int, generator: Optional[torch.Generator] = None,
    decoder: Optional[plumbing.StaticDecoder] = None, k: int = 1, filters: SamplingFilters = NO_FILTERS,
) -> Completions:
    """Sample k completions of each (g, Tq) query, (k, g) layout, and cut each after its first stop token."""
    responses = generate(policy, queries, query_mask, response_length, temperature, stop_token_id, pad_token_id,
                         generator, decoder, k, filters=filters)  # (k*g, Tr)
    return completions_of(queries, query_mask, responses, SamplingSettings(temperature, filters, response_length),
                          stop_token_id, pad_token_id)


def completions_of(queries: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor,
                   sampling: SamplingSettings, stop_token_id: Optional[int], pad_token_id: int,
                   sampler_logprobs: Optional[torch.Tensor] = None, prompt_index: Optional[torch.Tensor] = None
                   ) -> Completions:
    """Every RolloutSource's Completions: its (k*B, Tr) tokens of the (B, Tq) queries, Tr = sampling.max_new_tokens,
    cut after the first stop token, carrying `sampling` and `prompt_index`, the sampler's log-probs 0 on padding."""
    if responses.shape[1] != sampling.max_new_tokens:  # a source that sampled another batch's length
        raise ValueError(f"responses of {responses.shape[1]} tokens for a batch of {sampling.max_new_tokens}")
    responses, response_mask = truncate_after_stop(responses.to(queries.device), stop_token_id, pad_token_id)
    return Completions(queries, query_mask, responses, response_mask, sampling=sampling, prompt_index=prompt_index,
                       sampler_logprobs=None if sampler_logprobs is None else
                       sampler_logprobs.to(queries.device) * response_mask)


def chunks_by_prompt_length(query_mask: torch.Tensor, prompts_per_chunk: int) -> list[torch.Tensor]:
    """The B prompt indices in chunks of prompts_per_chunk, sorted by prompt length, so that each chunk pads to
    its own longest prompt, not the batch's."""
    order = torch.argsort(query_mask.sum(1), stable=True)  # (B,)
    return list(order.split(max(1, prompts_per_chunk)))


def put_rows(into: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """into[rows] = values: a chunk's or micro-batch's (N,) values, or (N, Tr') cut to its own width, back in a
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
    sampling: Optional[SamplingSettings] = None,
) -> Completions:
    """k completions of each of the B (B, Tq) queries, (k, B) layout, with `sampling` (None: the flags');
    local_rollout_forward_batch_size completions (whole prompt groups, length-sorted) at a time: the KV cache of a
    chunk is what must fit. Chunks draw from `generator` one after the other."""
    sampling = SamplingSettings.of(args) if sampling is None else sampling
    chunk = plumbing.rows_per_forward(args, policy, "generation", queries.device, k * queries.shape[0], k)
    responses = torch.full((k * queries.shape[0], sampling.max_new_tokens), pad_token_id, device=queries.device)
    sampler_logprobs = torch.zeros(responses.shape, device=queries.device)  # (k*B, Tr)
    with autocast():
        for prompts in chunks_by_prompt_length(query_mask, chunk // k):
            width = int(query_mask[prompts].sum(1).max())  # this chunk's longest prompt
            rows = completion_rows(prompts, queries.shape[0], k)
            logprobs = sampler_logprobs.new_zeros(len(rows), sampling.max_new_tokens)  # (k*g, Tr)
            responses[rows] = generate(
                policy, queries[prompts, -width:], query_mask[prompts, -width:], sampling.max_new_tokens,
                sampling.temperature, stop_token_id, pad_token_id, generator, decoder, k, logprobs,
                sampling.filters)  # (k*g, Tr)
            sampler_logprobs[rows] = logprobs
    return completions_of(queries, query_mask, responses, sampling, stop_token_id, pad_token_id, sampler_logprobs)


class RolloutSource(Protocol):
    """Where each update's completions come from (main's `make_rollouts` makes one): LocalRollouts, sampled in this
    process by the policy being trained; rloo_multinode.py's engines (HF or vLLM, served or colocated). `submit` asks
    for rloo_k completions of each (B, Tq) query with the batch's own settings (one it cannot carry is refused, never
    dropped); `take` gives the oldest batch's (completions_of: carrying its settings and its (B,) prompt_index, as wide
    as its max_new_tokens) and metrics of how they were made;
    `behaviour_policy` a with-block's module holding the weights that sampled it; `policy_updated` is called on
    every rank after each update's optimizer steps (returns metrics), `close` at the end, whatever ended the run."""

    lookahead: int  # batches sampled ahead of the one trained on (0: on-policy)
    max_metrics: tuple[str, ...]  # metrics of its own that are reduced over ranks by their maximum

    def submit(self, queries: torch.Tensor, query_mask: torch.Tensor, sampling: SamplingSettings,
               prompt_index: torch.Tensor) -> None: ...
    def take(self) -> tuple[Completions, dict[str, float]]: ...
    def behaviour_policy(self, policy) -> contextlib.AbstractContextManager: ...
    def policy_updated(self, update: int, policy) -> dict[str, float]: ...
    def close(self) -> None: ...


class LocalRollouts:
    """The RolloutSource of a single process: sampled by the policy being trained (or its bf16 copy)."""

    lookahead = 0
    max_metrics: tuple[str, ...] = ()

    def __init__(self, policy, args: Args, stop_token_id: Optional[int], pad_token_id: int,
                 generator: torch.Generator, autocast):
        self.args, self.stop_token_id, self.pad_token_id, self.generator = args, stop_token_id, pad_token_id, generator
        self.queued = []  # submit's arguments, oldest first
        # the module that samples: the policy under autocast, or a bf16 copy of it
        self.sampler = plumbing.bf16_copy(policy) if args.bf16_generation else policy
        self.autocast = contextlib.nullcontext if args.bf16_generation else autocast
        self.decoder = plumbing.StaticDecoder(self.sampler, args.max_prompt_length + args.response_length) \
            if args.compile_generation else None

    def submit(self, queries: torch.Tensor, query_mask: torch.Tensor, sampling: SamplingSettings,
               prompt_index: torch.Tensor) -> None:
        self.queued.append((queries, query_mask, sampling, prompt_index))

    def take(self) -> tuple[Completions, dict[str, float]]:
        queries, query_mask, sampling, prompt_index = self.queued.pop(0)
        return replace(sample_in_chunks(self.sampler, queries, query_mask, self.args.rloo_k, self.args,
                                        self.stop_token_id, self.pad_token_id, self.generator, self.autocast,
                                        self.decoder, sampling), prompt_index=prompt_index), {}

    @contextlib.contextmanager
    def behaviour_policy(self, policy):
        yield policy  # the policy itself sampled

    def policy_updated(self, update: int, policy) -> dict[str, float]:
        if self.sampler is not policy:
            plumbing.copy_weights(policy, self.sampler)
        return {}

    def close(self) -> None:
        pass


def logprobs_from_update(args: Args, sizes: BatchSizes, lookahead: int) -> bool:
    """Whether the settings allow the on-policy shortcut (one epoch and minibatch, sampled by the weights trained,
    micro-batches of whole groups): the update's forward gives the log-probs and the advantages a micro-batch at a
    time, exact where compute_advantages reads only its groups, which the first update checks (advantages_apart)."""
    return (args.num_ppo_epochs == 1 and sizes.minibatches == 1 and lookahead == 0 and sizes.micro % args.rloo_k == 0
            and not (args.use_peft and args.lora_dropout))  # a training forward with dropout is not the sampler's


@dataclass
class OnPolicyShortcut(plumbing.Verdict):
    """The shortcut's verdict, a part of the checkpoint: a resume goes on with the run's own, not a check of another
    batch (whose plain path would differ by rounding). Checked from the start where the settings rule it out."""

    checked: bool  # by the first update, on its own batch (advantages_apart)
    on: bool = False  # from the update after the check: the update's forward gives the log-probs and advantages


@torch.no_grad()
def collect_rollout(
    policy, ref_policy, completions: Completions, args: Args, share_prompt: bool, in_update: bool,
    autocast, timer: plumbing.PhaseTimer,
) -> Rollout:
    """The completions' log-probs under the policy that sampled them, of the distribution it sampled from (their
    temperature and filters, as the update's forward computes them; unless in_update: the update's forward gives them,
    logprobs_from_update), then under the reference, of softmax(logits / temperature) unfiltered: the KL is then
    KL(sampled || reference), >= 0 and finite (the reference gives every token mass), and counts what the filters cut as
    a distance. Each in length-sorted chunks of whole prompt groups."""
    c = completions

    def in_length_chunks(model, logprobs: Callable) -> torch.Tensor:
        chunk = plumbing.rows_per_forward(args, model, "logprobs", c.responses.device, c.responses.shape[0], c.k)
        return in_chunks(c, chunk, logprobs, width=c.responses.shape[1]) * c.response_mask  # (k*B, Tr), 0 on padding

    # recomputed with the training forward pass, not taken from sampling: the sequence-level ratio is the exp of
    # a sum, so small sampling-vs-training mismatches would blow up (bf16, fused kernels)
    logprobs = None
    if not in_update:
        with timer("policy_forward"), autocast():
            logprobs = in_length_chunks(policy, lambda part: forward_logprobs(
                policy, part, c.sampling.temperature, share_prompt, filters=c.sampling.filters)[0])  # (k*B, Tr)
    ref_logprobs = None
    if ref_policy is not None:
        with timer("reference_forward"), plumbing.visiting(ref_policy, c.responses.device), autocast():
            ref_logprobs = in_length_chunks(ref_policy, lambda part: forward_logprobs(
                ref_policy, part, c.sampling.temperature, share_prompt)[0])  # (k*B, Tr)
    return Rollout(**{f.name: getattr(c, f.name) for f in fields(c)}, logprobs=logprobs, ref_logprobs=ref_logprobs)


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
    grouped = grouped_rows_for(model, c)
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(**grouped.model_inputs(), use_cache=False).last_hidden_state  # (g, L, H)
    group = torch.arange(c.queries.shape[0], device=hidden.device).repeat(c.k)  # (k*g,) the (k, g) layout
    last = grouped.last_positions  # (k*g,)
    return model.score(hidden[group, last]).squeeze(-1).float()


def combine_rewards(values: torch.Tensor, applies: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the sources that apply. values and applies (S, N), weights (S,) -> (N,); NaN where none
    applies (TRL's: every reward function returned None, and no reward model), which rloo_advantages leaves out."""
    return (values * applies * weights[:, None]).sum(0).where(applies.any(0), torch.nan)


def score_completions(
    sources: plumbing.RewardSources, completions: Completions, examples: dict[str, list], prompt_column: str, tokenizer,
    stop_token_id: Optional[int], chunk_size: int, autocast,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(k*B,) combined score of each completion, and each source's mean. `examples`: the B dataset rows the completions
    came from (completion row j*B + i belongs to prompt i); reward functions get their prompts (prompt_values) and
    every other column."""
    c, n, device = completions, completions.responses.shape[0], completions.responses.device
    prompts = plumbing.prompt_values(examples, prompt_column, tokenizer)  # (B,)
    columns = {column: values for column, values in examples.items() if column not in (plumbing.PROMPT_IDS,
                                                                                         prompt_column)}
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
            span = slice(start, start + chunk_size)
            ids, mask = plumbing.retokenize(full_texts[span], ended[span], sources.model_tokenizer, device)
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
    per_source = {}  # NaN where a source applied to no completion (to one: its std), as TRL's nanmean/nanstd
    for name, v, a in zip(sources.names, values, applies):
        per_source[f"reward/{name}/mean"] = v[a].mean().item() if a.any() else float("nan")
        per_source[f"reward/{name}/std"] = v[a].std().item() if a.sum() > 1 else float("nan")
    return combine_rewards(values, applies, sources.weights).to(device), per_source


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
    """(k, g) rewards -> (k, g) mean reward of the other k-1 samples of the same prompt (column). A NaN reward (no
    source scored it) is left out of its siblings' baselines, as TRL does; its own, or one with no scored sibling, is
    NaN."""
    k = rewards.shape[0]
    if k < 2:
        raise ValueError(f"rloo_k = {k}: the leave-one-out baseline needs k >= 2")
    scored = (~rewards.isnan()).sum(0, keepdim=True)  # (1, g)
    return (rewards.nansum(0, keepdim=True) - rewards) / (scored - 1)


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
    per_completion = token_rewards.flatten(0, 1)  # (k*g, Tr), a view: the score goes to each one's last valid token
    per_completion[torch.arange(len(per_completion)), last_true_index(response_mask.flatten(0, 1))] += scores.flatten()
    returns = token_rewards.flip(-1).cumsum(-1).flip(-1)  # (k, g, Tr): sum of rewards from token t on
    return (returns - baseline[..., None]) * response_mask, rlhf_reward


def whiten(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Standardize x with statistics over its masked entries on all ranks."""
    mean, std = plumbing.global_mean_std(x, mask)
    out = (x - mean) / (std + 1e-8)
    return out if mask is None else out * mask


def kl_to_reference(rollout: Rollout) -> torch.Tensor:
    """(k*B, Tr) per-token log-ratio of the sampling policy to the reference (0 without a reference, and on padding):
    k1, whose sum is objective/kl whatever estimator the reward or the loss uses."""
    if rollout.ref_logprobs is None:
        return torch.zeros_like(rollout.logprobs)
    return rollout.logprobs - rollout.ref_logprobs


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """(N, Tr) Schulman's estimate of KL(policy || reference) at each sampled token from its log-probs (N, Tr), r =
    logref - logp: k1 = -r (unbiased), k2 = r^2 / 2 (biased, low variance), k3 = exp(r) - r - 1 (unbiased, >= 0)."""
    log_ref_ratio = ref_logprobs - logprobs  # (N, Tr) r
    if estimator == "k1":
        return -log_ref_ratio
    if estimator == "k2":
        return 0.5 * log_ref_ratio.square()
    return log_ref_ratio.exp() - log_ref_ratio - 1


@dataclass
class Advantages:
    """What compute_advantages gives a batch's k*g completions, for the loss and the metrics. A value a researcher adds
    is one more field: per completion (first dimension k*g; on-policy gathered from each micro-batch) or one value."""

    advantages: torch.Tensor  # (k*g,), or (k*g, Tr) per token
    rlhf_reward: torch.Tensor  # (k*g,) score - kl_coef * KL
    non_score_reward: torch.Tensor  # (k*g,) rlhf_reward - score: what the estimator added to the score
    reward_kl: torch.Tensor  # (k*g,) the reward's KL estimate summed over each completion's tokens

    def values(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def of_rows(self, rows: torch.Tensor, width: int) -> "Advantages":  # completions `rows`' (N, ..), width Tr'
        return Advantages(**plumbing.rows_of(self.values(), rows, len(self.advantages), width))


def compute_advantages(c: Rollout, scores: torch.Tensor, args: Args,
                       state: Optional[AlgorithmState] = None) -> Advantages:
    """The advantages and KL-penalized rewards of c's completions (a rollout's, or on-policy a micro-batch's whole
    prompt groups) from their scores (k*g,) and KL (--kl_estimator's, in the reward unless --kl_in_loss). The
    estimator's one caller: it hands it groups shaped (k, g), checks they come back so, and with
    --normalize_advantage whitens over every rank's batch. `state`: the run's AlgorithmState (None: a direct call)."""
    k, g, kl_coef = c.k, c.queries.shape[0], 0.0 if args.kl_in_loss else args.kl_coef
    kl = torch.zeros_like(c.logprobs) if c.ref_logprobs is None else \
        kl_estimate(c.logprobs, c.ref_logprobs, args.kl_estimator or "k1")  # (k*g, Tr)
    kl = kl if c.in_loss is None else kl * c.in_loss[:, None]  # TRL: a masked
    # completion's KL leaves its reward (its completion mask is zeroed), so its group's baselines see its raw score
    advantages, rlhf_reward = rloo_advantages(in_groups(scores, k), in_groups(kl, k), in_groups(c.response_mask, k),
                                              kl_coef, args.token_level_kl)
    if advantages.shape[:2] != (k, g) or rlhf_reward.shape != (k, g):
        raise ValueError(f"the advantage estimator returned advantages {tuple(advantages.shape)} and rlhf_reward "
                         f"{tuple(rlhf_reward.shape)} for groups (k, g) = {(k, g)}: it must keep that layout")
    advantages = advantages.flatten(0, 1)  # (k*g,), or (k*g, Tr)
    scored = ~advantages.isnan()  # NaN: a completion no source scored, or the one scored of its group (TRL's)
    if args.normalize_advantage:  # over the scored completions
        advantages = whiten(advantages, scored if advantages.dim() == 1 else scored & c.response_mask)
    rlhf_reward = rlhf_reward.flatten()  # (k*g,)
    return Advantages(advantages.where(scored, 0.0), rlhf_reward, rlhf_reward - scores,  # no signal from NaN
                      (kl * c.response_mask).sum(1))


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


def completions_in_loss(scores: torch.Tensor, has_stop: torch.Tensor, args: Args) -> Optional[torch.Tensor]:
    """(k*B,) bool: the completions whose loss counts (rollout.in_loss), from the scores and has_stop (k*B,); None:
    all. --mask_truncated_completions keeps those that stopped (TRL's). Filter groups here: in_groups(scores, k)."""
    return has_stop if args.mask_truncated_completions else None


def policy_loss(new_logprobs: torch.Tensor, batch: Rollout, values: Advantages, args: Args,
                entropy: Optional[torch.Tensor] = None,
                state: Optional[AlgorithmState] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each action's loss (ppo_update sums them over loss_normalizer), from a micro-batch's new log-probs and entropy
    (N, Tr), what the batch holds (old and reference log-probs, in_loss) and its compute_advantages `values`. A
    completion is one action with the sequence ratio exp(sum_t new - sum_t old): losses (N,); with --token_level_kl a
    token is, with its own ratio: losses (N, Tr), 0 on padding. The clipped surrogate with the ratio in
    [1 - cliprange, 1 + cliprange_high], plus kl_coef x the KL (--kl_estimator's) with --kl_in_loss, times the
    importance weight with --vllm_importance_sampling_correction; 0 for the completions outside batch.in_loss, which
    leave the statistics too. `state`: as compute_advantages'."""
    old_logprobs, response_mask, in_loss = batch.logprobs, batch.response_mask, batch.in_loss  # (N, Tr) x2, (N,)
    advantages, per_token = values.advantages, args.token_level_kl  # (N,), or (N, Tr) per token
    if per_token:
        log_ratio = (new_logprobs - old_logprobs) * response_mask  # (N, Tr)
        advantages = advantages if advantages.dim() == 2 else advantages[:, None]  # (N, Tr) or (N, 1)
        weight = response_mask.float()  # which entries count
    elif advantages.dim() == 1:
        log_ratio = sequence_log_ratio(new_logprobs, old_logprobs, response_mask)  # (N,)
        weight = torch.ones_like(advantages)
    else:
        raise ValueError("per-token advantages (N, Tr) need per-token actions (--token_level_kl)")
    token_mask = response_mask
    if in_loss is not None:  # (N,) -> the entries of the completions left out weigh 0
        weight = weight * (in_loss[:, None] if per_token else in_loss)
        token_mask = response_mask & in_loss[:, None]
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange_high)
    per_action = torch.max(losses, losses_clipped)  # (N,) or (N, Tr)
    if args.kl_in_loss:  # GRPO's k3 = exp(ref - new) - (ref - new) - 1 per token by default; its gradient flows
        estimator = args.kl_estimator or "k3"
        kl = kl_estimate(new_logprobs * response_mask, batch.ref_logprobs * response_mask, estimator)  # (N, Tr)
        per_action = per_action + args.kl_coef * (kl if per_token else kl.sum(1))
    if args.vllm_importance_sampling_correction:  # (N,) or (N, Tr) weights; a sequence's is each of its tokens'
        if batch.sampler_logprobs is None:
            raise plumbing.ConfigError("--vllm_importance_sampling_correction needs the sampler's log-probs, which "
                                       "this rollout source does not return: drop the flag")
        is_weights = importance_weights(old_logprobs, batch.sampler_logprobs, response_mask,
                                        args.vllm_importance_sampling_mode, args.vllm_importance_sampling_cap)
        per_action = per_action * (is_weights if is_weights.dim() == per_action.dim() else is_weights[:, None])
    with torch.no_grad():  # under the names they are logged with, as are ppo_update's
        low = (ratio < 1.0 - args.cliprange) & (advantages < 0)  # where the clip acts: below for A < 0, above for A > 0
        high = (ratio > 1.0 + args.cliprange_high) & (advantages > 0)
        stats = {"policy/clipfrac_avg": masked_mean((losses_clipped > losses).float(), weight),
                 "policy/approxkl_avg": 0.5 * masked_mean(log_ratio**2, weight),
                 "clip_ratio/low_mean": masked_mean(low.float(), weight),  # TRL 1.x's names
                 "clip_ratio/high_mean": masked_mean(high.float(), weight),
                 "clip_ratio/region_mean": masked_mean((low | high).float(), weight),
                 "clip_ratio/low_min": low.float().min(), "clip_ratio/high_max": high.float().max()}  # TRL 1.16's
        if args.kl_in_loss:  # the loss's KL term under the policy as it trains, per completion
            stats[f"policy/kl_{estimator}_avg"] = kl.sum(1).mean()
        if entropy is not None:
            stats["policy/entropy_avg"] = stats["entropy"] = masked_mean(entropy, token_mask)  # TRL 1.x: entropy
    return per_action * weight if per_token or in_loss is not None else per_action, stats


def loss_normalizer(rollout: Rollout, minibatch: list[torch.Tensor]) -> torch.Tensor:
    """What each micro-batch's summed losses are divided by: the minibatch's completions per rank (averaged over
    ranks, as DDP and FSDP average gradients), counted before its first micro-batch, so that the loss does not depend
    on how it is cut into micro-batches. Per-token losses then give the mean of each completion's sum."""
    rows = torch.cat(minibatch)  # (N,) this rank's completions of the minibatch
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


def advantages_apart(rollout: Rollout, scores: torch.Tensor, whole: Advantages, args: Args, sizes: BatchSizes,
                     state: AlgorithmState) -> Optional[str]:
    """Whether compute_advantages gives each micro-batch's whole prompt groups (a plan as ppo_update draws one) what it
    gave them in the whole batch (`whole`: of the rollout, every field it carries, and its scores (k*B,)): the first
    difference in words (plumbing.apart_difference), or None. A collective (compute_advantages may reduce)."""
    device = rollout.responses.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run's draws unmoved
        parts = [rows for minibatch in minibatch_plan(rollout, sizes, args.rloo_k) for rows in minibatch]
    return plumbing.apart_difference(whole.values(), parts, lambda rows: compute_advantages(
        micro_batch(rollout, rows, args.rloo_k), scores[rows], args, state).values())


def ppo_update(
    model, optimizer: torch.optim.Optimizer, rollout: Rollout, scores: torch.Tensor, args: Args, sizes: BatchSizes,
    share_prompt: bool, autocast, ref_policy=None, steps_done: int = 0, state: Optional[AlgorithmState] = None,
    learning_rate: Optional[Callable[[int], float]] = None, steps: Optional[int] = None,
) -> tuple[dict[str, float], Advantages]:
    """num_ppo_epochs x shuffled minibatches (an optimizer step each) x micro-batches (minibatch_plan) of policy_loss.
    Advantages come from the scores (k*B,) by compute_advantages, before the first step; or on-policy (rollout.logprobs
    None) per micro-batch from its own forward, whose detached log-probs are the ratio's denominator (put in
    rollout.logprobs). Returns its metrics, averaged over micro-steps, and what it trained on (k*B rows).
    --sync_ref_model: after every ref_model_sync_steps-th optimizer step of the run, ref_policy mixes in the policy.
    `state`: the run's AlgorithmState (None: its start), handed to compute_advantages and policy_loss. Optimizer step
    s of the run (steps_done before this update's) takes learning_rate(s) (None: the optimizer's); `steps`: the first
    this many steps only (the run's last update under TRL 1.16's arithmetic, plumbing.schedule.RunLength; None: all)."""
    state = AlgorithmState.start(args, 0) if state is None else state
    stats: dict[str, list[torch.Tensor]] = {}
    ratios, grad_norms = [], []
    device, k = scores.device, rollout.k
    max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
    in_update = rollout.logprobs is None  # on-policy: the update's forward gives them (logprobs_from_update)
    if in_update:  # filled below, a micro-batch at a time, as is every value compute_advantages returns
        rollout.logprobs = torch.zeros(rollout.responses.shape, device=device)  # (k*B, Tr)
    trained_on, gathered = None if in_update else compute_advantages(rollout, scores, args, state), {}  # all at once
    steps = args.num_ppo_epochs * sizes.minibatches if steps is None else steps  # optimizer steps of this update
    for epoch in range(-(-steps // sizes.minibatches)):
        for minibatch in minibatch_plan(rollout, sizes, k)[: steps - epoch * sizes.minibatches]:  # alike on every rank
            plumbing.same_plan(f"takes step {steps_done + 1} (epoch {epoch + 1}): micro-batches {len(minibatch)}")
            normalizer = loss_normalizer(rollout, minibatch)  # counted once: every micro-batch divides by it
            losses = []
            for micro_step, rows in enumerate(minibatch):
                batch = micro_batch(rollout, rows, k)  # (N, Tr') responses, N = len(rows); its prompts once each
                with plumbing.gradient_sync(model, enabled=micro_step == len(minibatch) - 1), autocast():
                    new_logprobs, entropy = forward_logprobs(model, batch, batch.sampling.temperature, share_prompt,
                                                             True, batch.sampling.filters)  # (N, Tr') each
                    if in_update:  # whole prompt groups, all that compute_advantages reads (logprobs_from_update)
                        batch.logprobs = new_logprobs.detach() * batch.response_mask
                        put_rows(rollout.logprobs, rows, batch.logprobs)
                        values = compute_advantages(batch, scores[rows], args, state)
                        plumbing.put_rows_of(gathered, rows, values.values(), rollout.responses.shape)  # (k*B, ..)
                    else:
                        values = trained_on.of_rows(rows, batch.responses.shape[1])  # (N,) or (N, Tr')
                    action_losses, step_stats = policy_loss(new_logprobs, batch, values, args, entropy,
                                                            state)  # (N,) or (N, Tr')
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
            if learning_rate is not None:  # the run's schedule: this optimizer step's rate
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(steps_done + 1)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps_done += 1
            if args.sync_ref_model and steps_done % args.ref_model_sync_steps == 0:
                sync_reference(ref_policy, plumbing.unwrapped(model), args.ref_model_mixup_alpha)
    plumbing.same_plan(f"ends its update after step {steps_done}")
    ratios = torch.cat(ratios)  # (num_ppo_epochs * k*B,) sequence-level ratios, whatever the loss's level
    out = {key: torch.stack(values).mean().item() for key, values in stats.items()}
    out["val/ratio"] = ratios.mean().item()
    out["val/ratio_var"] = ratios.var().item() if ratios.numel() > 1 else 0.0
    out["policy/grad_norm"] = torch.stack(grad_norms).mean().item()
    out |= {"loss": out["loss/policy_avg"], "grad_norm": grad_norms[-1].item()}  # TRL 1.16's names: at the last step
    if rollout.in_loss is not None:  # reduced over ranks by a sum
        out["completions/masked_truncated"] = float((~rollout.in_loss).sum())
    return out, trained_on or Advantages(**gathered)


@torch.no_grad()
def sync_reference(ref_policy, policy, alpha: float) -> None:
    """TR-DPO's reference update: ref <- alpha * policy + (1 - alpha) * ref, each weight computed in fp32 and stored
    in the reference's own dtype (bf16 with --bf16). Every rank computes the same: the reference stays replicated."""
    for ref, new in zip(ref_policy.parameters(), policy.parameters(), strict=True):
        ref.copy_(alpha * new.float() + (1 - alpha) * ref.float())


# ===================================================================== evaluation
EVAL_TEMPERATURE = 0.01  # near-greedy, as TRL's evaluation samples


@torch.no_grad()
def evaluate(
    policy, eval_dataset, sources: plumbing.RewardSources, tokenizer, args: Args, stop_token_id: Optional[int],
    dist_info: plumbing.Dist, autocast,
) -> dict[str, float]:
    """Mean score of near-greedy completions (num_generations_eval per prompt, from the distribution training samples
    from at EVAL_TEMPERATURE: the filters and the repetition penalty apply, as TRL's evaluation keeps its generation
    settings) of up to eval_max_prompts test prompts, spread over the ranks."""
    k = args.num_generations_eval or 1
    indices = list(range(dist_info.rank, min(len(eval_dataset), args.eval_max_prompts), dist_info.world_size))
    totals = plumbing.EvalTotals(dist_info.device)  # over every rank's completions
    chunk = min(plumbing.rows_per_forward(args, policy, "generation", dist_info.device, k * len(indices), k),
                plumbing.rows_per_forward(args, sources.model, "scoring", dist_info.device, k * len(indices), k))
    prompts_per_chunk = max(chunk // k, 1)
    plumbing.note_phase("evaluation")
    with plumbing.reward_faults(dist_info.device, "evaluation", after_training=True):
        for start in range(0, len(indices), prompts_per_chunk):
            examples = eval_dataset[indices[start : start + prompts_per_chunk]]
            queries, query_mask = plumbing.pad_sequences(examples[plumbing.PROMPT_IDS], tokenizer.pad_token_id,
                                                         dist_info.device)  # (g, Tq)
            with autocast():
                completions = sample_completions(policy, queries, query_mask, args.response_length, EVAL_TEMPERATURE,
                                                 stop_token_id, tokenizer.pad_token_id, k=k,
                                                 filters=SamplingFilters.of(args))  # (k*g, Tr), (k, g) layout
            scores, _ = score_completions(sources, completions, examples, args.prompt_column, tokenizer, stop_token_id,
                                          k * prompts_per_chunk, autocast)  # (k*g,)
            totals.add(scores, completions.response_mask, completions.ended(stop_token_id))
    return totals.metrics()  # eval/scores, eval/mean_length, eval/eos_frac


# ===================================================================== main
def main(args: Args, make_rollouts: Callable[..., RolloutSource] = LocalRollouts) -> None:
    """Train: set up, then the six steps of each update. `make_rollouts(policy, args, stop_token_id, pad_token_id,
    generator, autocast)` gives the RolloutSource (LocalRollouts); rloo_multinode.py passes its engines'."""
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
    checkpoints = plumbing.Checkpointer(args, dist_info, lock, reward_functions)  # output_dir locked, where to resume
    with checkpoints.refusal_leaves_nothing():
        plumbing.choose_kernels()
        autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=args.bf16)
        with plumbing.startup_step("loaded the tokenizer", master):
            tokenizer, vocab_size = plumbing.prepare_tokenizer(args)  # and the models' configs checked
        with plumbing.startup_step("loaded the prompts", master) as said:
            dataset, eval_dataset, dropped = plumbing.load_prompts(args, tokenizer, vocab_size,
                                                                      plumbing.prompt_token_ids)
            said.append(f"{len(dataset)} train" + (f", {len(eval_dataset)} test" if eval_dataset else "")
                        + f"; {plumbing.describe_prompt_lengths(dropped, args.max_prompt_length)}")
        sampler = plumbing.PromptSampler(len(dataset), sizes.prompts, dist_info.rank, dist_info.world_size, args.seed)
        state = AlgorithmState.start(args, len(dataset))
        plumbing.check_reward_function_arguments(reward_functions, [
            (args.dataset_name, dataset), (args.dataset_test_split, eval_dataset)], args.prompt_column)
        steps_per_update = args.num_ppo_epochs * sizes.minibatches  # optimizer steps
        run = plumbing.run_length(args, len(dataset) * args.rloo_k, sizes.all_ranks, steps_per_update)
        num_updates, learning_rate = run.updates, plumbing.learning_rates(args, run)  # of each optimizer step
        save_every, log_every = plumbing.update_intervals(args, run)  # in updates
        checkpoints.check_continues(num_updates, sizes.all_ranks, algorithm_state=state, sampler=sampler)
        reference = "" if args.kl_coef == 0 else " and its reference" + (" (adapters off)" if args.use_peft else "")
        with plumbing.startup_step(f"loaded the policy{reference}", master):
            policy, ref_policy, tokenizer, stop_token_id = load_policy(args, device, checkpoints.path, tokenizer)
        with plumbing.startup_step("loaded the reward model" if args.reward_model_path else "set up the reward "
                                   "functions", master):
            sources = plumbing.load_reward_sources(args, tokenizer, reward_functions, device)
        # each prompt computed once for its k completions, in every phase, where the model can take it exactly;
        # notes: printed once the run starts
        share_prompt, notes = plumbing.prompt_sharing(
            args, dataset[0][plumbing.PROMPT_IDS], policy, sources, device, master, Completions,
            lambda c, share: forward_logprobs(policy, c, 1.0, share)[0][c.response_mask], reward_model_scores)

        # the policy as training calls it (FSDP2 in place, DDP, or itself); `policy` samples, scores and is saved
        trained = plumbing.for_training(policy, args.fsdp, args.bf16, args.offload, device)
        trainable = [p for p in policy.parameters() if p.requires_grad]  # all, or with --use_peft the adapters
        optimizer = torch.optim.AdamW(plumbing.weight_decay_groups(policy, trainable, args.weight_decay),
                                      lr=args.learning_rate, eps=args.adam_epsilon,
                                      fused=device.type == "cuda" and not args.offload)  # one kernel for all tensors
        # python's, numpy's and torch's generators seeded (each rank differently), and .sampling, only sampling's own
        generators = plumbing.Generators(args.seed + dist_info.rank, device)
        run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
        logger = plumbing.RunLogger(args, run_name, num_updates, checkpoints.start_update, checkpoints.wandb_run_id,
                                    checkpoints.run_id, log_every) if master else None
        checkpoints.wandb_run_id = logger and logger.wandb_run_id  # saved with each checkpoint, for a resume
        rollouts = make_rollouts(policy, args, stop_token_id, tokenizer.pad_token_id, generators.sampling, autocast)
        # the update's forward may give the log-probs: checked on the first update's batch, which takes the plain path
        shortcut, apart = OnPolicyShortcut(checked=not logprobs_from_update(args, sizes, rollouts.lookahead)), ""
        timer = plumbing.PhaseTimer(device)
        timer.count_tokens_of(policy, ref_policy, sources.model, getattr(rollouts, "sampler", None))
        checkpoints.restore(policy=policy, tokenizer=tokenizer,  # the run's stateful parts, one a line (HF, once)
            optimizer=optimizer,  # once (with FSDP: each rank its shard)
            reference=ref_policy,  # once, whenever its weights are no longer those it was loaded with
            algorithm_state=state,  # this and every part below: per rank, each rank's own
            on_policy_shortcut=shortcut,  # the first update's verdict
            sampler=sampler,  # where the oldest batch not yet trained on was drawn (data_position)
            rollouts=rollouts if hasattr(rollouts, "state_dict") else None,  # the rollout source's own, if any
            generators=generators)  # restored last: as seeded, or the checkpoint's (nothing draws in between)
        notes = (checkpoints.notes() if master else []) + notes  # output_dir settled, once no refusal can come
        if logger is not None:  # the run's shape and its learning rates' reach, after the checks' notes
            logger.print_notes(notes + plumbing.run_notes(
                run_name, num_updates, sizes.prompts, args.rloo_k, dist_info.world_size, len(dataset), sources.names,
                policy, trainable, args, run) + plumbing.movement_note(trainable, args, plumbing.sum_over_updates(
                learning_rate, run.steps)))
    eval_at = plumbing.evaluation_updates(args, run, len(dataset) // sampler.per_update) \
        if eval_dataset is not None else set()
    sample_every = max(1, num_updates // args.num_sample_generations) if args.num_sample_generations > 0 else 0
    queued: list[plumbing.PromptBatch] = []  # drawn, sampled or being sampled, not yet trained on

    def data_position() -> dict:  # the sampler before the oldest batch not yet trained on: where a resume draws again
        return queued[0].sampler_state if queued else sampler.state_dict()

    def evaluation(update: int, episode: int) -> None:
        policy.eval()
        with plumbing.gathered_for_rollout(policy, args.fsdp_generation), plumbing.visiting(sources.model, device):
            eval_metrics = evaluate(policy, eval_dataset, sources, tokenizer, args, stop_token_id, dist_info, autocast)
        if logger is not None:
            logger.log_eval(update, eval_metrics, episode)

    stop_signal.training = True
    try:
        update, restart = checkpoints.start_update, {}  # what a fault in the initial evaluation reports: nothing new
        if eval_at and update == 0:  # the initial policy: where the curves start (not again on resume)
            evaluation(0, 0)
        for update in range(checkpoints.start_update + 1, num_updates + 1):
            timer.start_update()
            update_start = time.perf_counter()
            restart = dict(checkpoints.states(), sampler=data_position())  # what a stop or fault in the update saves

            # ALGO LOGIC 1-3. k completions of each of B prompts, then their log-probs under the sampling policy and
            # the reference. The rollout source may sample ahead (rollouts.lookahead batches: rloo_multinode.py's
            # --async_generation): the queue is topped up first, then the oldest batch is taken
            policy.eval()
            with plumbing.gathered_for_rollout(policy, args.fsdp_generation):
                while len(queued) <= min(rollouts.lookahead, num_updates - update):
                    sampler_state, rows = sampler.state_dict(), sampler.next_indices()  # B rows of the split
                    batch = plumbing.PromptBatch.of(dataset, rows, sampler_state, tokenizer.pad_token_id, device)
                    # what samples the batch of update `update + len(queued)`, which carries it to every log-prob
                    # of it (Completions.sampling): a schedule of a sampling setting or the length is this line
                    sampling = SamplingSettings.of(args)
                    rollouts.submit(batch.queries, batch.query_mask, sampling, batch.prompt_index)  # k each
                    queued.append(batch)
                with checkpoints.kept_if_rollouts_fail(update - 1, restart), timer("generation"):
                    completions, rollout_metrics = rollouts.take()  # (B, Tq) queries, (k*B, Tr) responses
                prompt_batch = queued.pop(0)
                with rollouts.behaviour_policy(policy) as behaviour:
                    rollout = collect_rollout(behaviour, ref_policy, completions, args, share_prompt, shortcut.on,
                                              autocast, timer)  # (k*B, Tr) log-probs
            has_stop = rollout.ended(stop_token_id)  # (k*B,)

            # ALGO LOGIC 4. score every completion (reward model and reward functions), then the missing-EOS penalty
            with timer("scoring"):
                with plumbing.visiting(sources.model, device), \
                        plumbing.reward_faults(device, f"scoring of update {update}"):
                    chunk = plumbing.rows_per_forward(args, sources.model, "scoring", device, len(rollout.responses),
                                                      args.rloo_k)
                    raw_scores, source_means = plumbing.said_if_unscored(update, sources, *score_completions(
                        sources, rollout, prompt_batch.examples, args.prompt_column, tokenizer, stop_token_id, chunk,
                        autocast))  # (k*B,)
                scores = apply_missing_eos_penalty(raw_scores, has_stop, args.missing_eos_penalty)  # (k*B,)
                if args.normalize_reward:
                    scores = whiten(scores, ~scores.isnan()).clamp(-args.reward_clip_range, args.reward_clip_range)
            rollout.in_loss = completions_in_loss(scores, has_stop, args)  # (k*B,) bool, or None: all count

            # ALGO LOGIC 5-6. KL-penalized rewards and leave-one-out advantages (compute_advantages), then PPO epochs
            # of the clipped surrogate. On-policy, the update computes them from its own forward (logprobs_from_update)
            policy.train()  # switches gradient checkpointing on, and LoRA's --lora_dropout (every other dropout is off)
            with timer("training"), plumbing.batch_kept_if_nonfinite(args.output_dir, update, dist_info.rank,
                                                                     tokenizer, rollout, raw_scores):
                plumbing.check_finite({  # without a reward model, NaN is a completion no source scored (TRL's)
                    "reward": raw_scores if sources.model else raw_scores[~raw_scores.isnan()],
                    "log-prob": rollout.logprobs, "reference log-prob": rollout.ref_logprobs}, device)  # every rank
                train_stats, trained_on = ppo_update(trained, optimizer, rollout, scores, args, sizes, share_prompt,
                                                     autocast, ref_policy, (update - 1) * steps_per_update, state,
                                                     learning_rate, run.steps_in(update))
            if not shortcut.checked:  # the first update: the shortcut from the next one on, or never
                apart = advantages_apart(rollout, scores, trained_on, args, sizes, state)
                shortcut.checked, shortcut.on = True, apart is None
            rollout_metrics.update(rollouts.policy_updated(update, policy))  # rloo_multinode.py: the engines' sync

            # log (this rank's metrics under TRL's names, then reduced over ranks), evaluate, save
            kl = kl_to_reference(rollout) * rollout.response_mask  # (k*B, Tr) k1 of each valid token
            metrics = {
                "objective/kl": kl.sum(1).mean().item(),  # TRL <= 0.21's: of the sequences
                **({"kl": (kl.sum().item(), rollout.response_mask.sum().item())} if ref_policy is not None else {}),
                # ^ TRL 1.16's, only with a reference: per token, over every rank's (a pair: plumbing.reduce_metrics)
                **({f"objective/kl_{args.kl_estimator}": trained_on.reward_kl.mean().item()} if ref_policy is not None
                   and not args.kl_in_loss and args.kl_estimator not in (None, "k1") else {}),  # the reward's
                "objective/entropy": (-rollout.logprobs * rollout.response_mask).sum(1).mean().item(),
                "objective/non_score_reward": trained_on.non_score_reward.nanmean().item(),  # compute_advantages's
                "objective/rlhf_reward": trained_on.rlhf_reward.nanmean().item(),  # of the scored completions (TRL's)
                "objective/scores": scores.nanmean().item(),
                "objective/raw_scores": raw_scores.nanmean().item(),
                "reward": raw_scores.nanmean().item(),  # TRL 1.x: the sources' weighted sum
                **train_stats,  # policy/*, loss/policy_avg, val/ratio*
                **plumbing.completion_metrics(rollout.response_mask, has_stop, raw_scores,
                                              in_groups(trained_on.rlhf_reward, args.rloo_k)),  # TRL 1.16's
                **({} if rollout.sampler_logprobs is None else plumbing.mismatch_metrics(rollout, args.cliprange,
                   args.cliprange_high, args.vllm_importance_sampling_cap, functools.partial(importance_weights,
                   mode=args.vllm_importance_sampling_mode, cap=args.vllm_importance_sampling_cap)
                   if args.vllm_importance_sampling_correction else None)),
                **source_means, **rollout_metrics, **timer.metrics(),
                "work/minimum_tokens": plumbing.minimum_forward_tokens(rollout, sum(
                    args.num_ppo_epochs if phase == "training" else 1 for phase in timer.tokens)),
                "time/update": time.perf_counter() - update_start,  # all of the update but evaluation and saving
            }
            episode = update * sizes.all_ranks
            metrics = plumbing.reduce_metrics(metrics, device, rollouts.max_metrics)
            metrics.update(state.after_update(args, rollout, raw_scores, trained_on, metrics))  # where state changes
            lr = optimizer.param_groups[0]["lr"]  # the update's last optimizer step's: TRL 1.16's learning_rate too
            metrics.update(eps=episode / (time.time() - checkpoints.start_time), lr=lr, learning_rate=lr,
                           episode=episode)
            if logger is not None:
                logger.log(update, metrics)
                if update == checkpoints.start_update + 1:  # what the run's first update showed
                    logger.print_notes(plumbing.on_policy_notes(update, apart, metrics, args.cliprange,
                                                                args.cliprange_high))
                if args.log_completions or (sample_every and (update - 1) % sample_every == 0):
                    logger.sample_table([(tokenizer.decode(rollout.queries[i % sizes.prompts][rollout.query_mask[
                        i % sizes.prompts]]), tokenizer.decode(rollout.responses[i][rollout.response_mask[i]]),
                        scores[i].item()) for i in plumbing.table_rows(args, sizes.prompts)], episode)
            if update in eval_at:
                evaluation(update, episode)
            stop = stop_signal.requested(device)  # on every rank as soon as any rank got a signal
            if stop or update == num_updates or (save_every > 0 and update % save_every == 0):
                checkpoints.save(update, sampler=data_position())
            if stop:
                checkpoints.stopped(logger, f"{stop_signal.name or 'a signal to another rank'} received: stopped "
                                            f"after update {update}")
                break
        else:  # the final policy, its tokenizer and args.json: their presence in output_dir marks a finished run
            checkpoints.finish(policy, num_updates, logger)
    except (plumbing.RewardFunctionError, plumbing.MetricsWriteError) as e:  # keep the last finished update, stop
        checkpoints.fault(e, update, dict(sampler=data_position()), restart, logger)
    finally:  # an error on one rank alone must not wait for the others: torchrun stops them
        rollouts.close()
        if logger is not None:
            logger.close()
    plumbing.barrier("the end of the run")
    del trained  # DDP's reducer must not be what frees the process group (plumbing.end_distributed)
    plumbing.end_distributed()
    lock.release()  # a finished or stopped run leaves no lock (one that fails releases it on exit)


# ===================================================================== command line
if __name__ == "__main__":
    program = Path(__file__).name  # a copy's errors and --help name the copy
    plumbing.run_script(main, plumbing.parse_args(Args, prog=program), program)
