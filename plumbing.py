"""The plumbing of rloo.py: what a run needs and nobody changes when changing the algorithm.

rloo.py holds the algorithm and imports this module; rloo_multinode.py imports both. Copying rloo.py means copying
this file with it. Nothing here imports rloo.py: what needs the run's objects takes them as arguments.

Sections:
  errors          ConfigError (bad input: one line, exit 2) and Fault (a run stopped: one line, exit 4)
  flags           InputArgs (models, data) and RunArgs (the run's flags), which rloo.py's Args extends; the checks
                  before anything loads
  distributed     torchrun ranks and their device, FSDP2 sharding and gathering, all-reduce, statistics over ranks
  data files      Hub datasets and local files, with one-line diagnostics of what is wrong in them
  models          loading errors, configs checked before weights load, kernels (the fused log-softmax), LoRA
                  adapters and their reference, whether a model takes grouped rows (and the start-up check that it
                  does), the bf16 sampling copy, the reward sources, KV caches
  faults          the rollout source, reward functions (run with a timeout), NaN/inf and the offending batch
  measuring       phase times, token-forwards against the minimum, free memory -> rows per forward pass, the
                  sampler/trainer mismatch
  logging         metrics over ranks, console, metrics.jsonl, wandb
  signals         stop signals, late ranks
  checkpoints     one run per output_dir, verified saves, resume, nothing deleted
  command line    TRL >= 0.22's names, exit statuses
"""

import atexit
import contextlib
import copy
import datetime
import difflib
import fcntl
import fnmatch
import functools
import gc
import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import numbers
import os
import pickle
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Annotated, Callable, ClassVar, Literal, Optional, get_args, get_origin, get_type_hints

import docstring_parser
import numpy as np
import torch
import torch.distributed as dist
import tyro
import tyro._errors  # parse_args' one-line parse errors
from torch.nn.parallel import DistributedDataParallel as DDP


# ===================================================================== errors: bad input (exit 2), faults (exit 4)
class ConfigError(Exception):
    """Bad input the user can fix; reported as one line and exit status 2."""


class Fault(Exception):
    """A failure outside the training state stopped the run (a reward function, the disk, a rank that stopped
    answering); reported as one line saying what was saved, exit status 4. `announce`: whether this rank prints it
    (one rank says it for all)."""

    def __init__(self, message: str, announce: bool = True):
        super().__init__(message)
        self.announce = announce


def describe(e: BaseException) -> str:
    """What an exception says, in one line, for the one-line errors: bytes that are not UTF-8 named as such."""
    if isinstance(e, UnicodeError):
        where = f" (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})" if isinstance(
            e, UnicodeDecodeError) else ""
        return f"it is not UTF-8 text{where}"
    return f"{type(e).__name__}: {first_line(e)}"


@contextlib.contextmanager
def reading(what: str, fix: str):
    """The one boundary of an input: whatever reading `what` raises (an error of this project's passes as it is)
    becomes a ConfigError, one line naming the input, what is wrong and `fix`. Each input is read inside one."""
    try:
        yield
    except (ConfigError, Fault):
        raise
    except Exception as e:  # any library's, any type: the user needs the input, the first line, the fix
        raise ConfigError(f"{what}: {describe(e)}; {fix}") from None


FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38: beyond it a value is inf in the tensors it meets


# ===================================================================== flags: the run's, and their checks
@dataclass
class InputArgs:
    """A run's inputs: the policy, the reward, the prompts. RunArgs extends it and rloo.py's Args extends RunArgs:
    these are flags like the others, listed first by --help and docs/flags.md."""

    # ----- models -----
    model_name_or_path: Optional[str] = None
    """policy tokenizer, and policy weights unless --sft_model_path is given (Hub id or local path)"""
    sft_model_path: Optional[str] = None
    """policy and reference weights when they are not at --model_name_or_path (as in TRL's TL;DR recipe)"""
    reward_model_path: Optional[str] = None
    """AutoModelForSequenceClassification with one label, read at the last real token; when its own
    tokenizer differs from the policy's, completions are decoded and re-tokenized for it"""
    reward_fn: tuple[str, ...] = ()
    """Python reward functions `package.module:function`, called with prompts, completions,
    completion_ids and the dataset's other columns (lists); each returns a float or None per completion"""
    reward_weights: Optional[tuple[float, ...]] = None
    """one weight per reward source, the reward model first, then each --reward_fn; default all 1.0"""
    pad_token: Optional[str] = "[PAD]"
    """token added for padding when the policy tokenizer has none (as TRL and the N+ details do for Pythia); its id
    must fit the embedding matrix. None refuses tokenizers without a pad token"""
    bf16: bool = False
    """bf16 autocast for every forward pass; fp32 master weights and optimizer; frozen models stored in bf16"""
    model_revision: str = "main"
    """the Hub revision (branch, tag or commit) of the policy, its tokenizer and its reference, where
    --model_name_or_path / --sft_model_path is a Hub id (TRL's); a local directory is refused with another revision"""
    attn_implementation: Optional[str] = None
    """transformers' attention of the policy and the reward model: sdpa or eager (grouped rows need a 4D mask);
    None: transformers' default (sdpa where the model has it)"""

    # ----- data -----
    dataset_name: str = "trl-internal-testing/tldr-preference-sft-trl-style"
    """Hub dataset id, a local .jsonl/.json/.parquet file, or a `save_to_disk` directory"""
    dataset_config: Optional[str] = None
    """the Hub dataset's configuration name, if it has several"""
    dataset_train_split: str = "train"
    """split to train on (ignored for a single local file)"""
    dataset_test_split: Optional[str] = None
    """split (or local file) to evaluate on; None disables evaluation"""
    prompt_column: str = "prompt"
    """column holding the prompt: a string, or a list of chat messages (chat template applied);
    without it, a pre-tokenized `query_token` column is used (the TL;DR dataset's schema)"""
    max_prompt_length: int = 512
    """prompts longer than this many tokens are dropped (and counted) when the dataset is loaded"""


@dataclass
class RunArgs(InputArgs):
    """The run's flags that are neither the algorithm's nor its inputs (InputArgs): its name and output_dir, trust,
    memory and speed, LoRA, samples and evaluations, checkpoints and faults. rloo.py's Args extends it, so these are
    flags like the others (--help and docs/flags.md list them last)."""

    resumable_changes: ClassVar[frozenset] = frozenset({  # may differ on --resume; any other flag is another experiment
        "exp_name", "run_name", "output_dir", "track", "wandb_project_name", "wandb_entity", "trust_remote_code",
        "dataset_test_split", "num_sample_generations", "num_evals", "eval_max_prompts",
        "local_rollout_forward_batch_size", "gradient_checkpointing", "total_episodes", "num_train_epochs",
        "save_steps", "save_total_limit", "resume", "resume_from", "overwrite_output_dir", "ddp_timeout",
        "fsdp_generation", "compile_generation", "share_prompt", "bf16_generation", "reward_fn_timeout",
        "merge_lora", "logging_steps", "save_strategy", "max_steps", "allow_changed_inputs"})

    # ----- experiment -----
    exp_name: str = "rloo"
    """name of the experiment; the run is named `{exp_name}__{seed}__{unix time}` unless --run_name is given"""
    run_name: Optional[str] = None
    """the run's whole name (wandb, the log's first line), as TRL >= 0.22 takes it;
    None: `{exp_name}__{seed}__{unix time}`"""
    seed: int = 1
    """random seed; rank r samples with seed + r"""
    output_dir: str = "models/rloo"
    """where `metrics.jsonl`, `args.json`, the final policy and its tokenizer are written"""
    track: bool = False
    """log to Weights & Biases (with WANDB_MODE=offline it logs without network)"""
    wandb_project_name: str = "rloo"
    """the wandb project"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team); None is your default entity"""
    trust_remote_code: bool = False
    """allow models and tokenizers with custom code from the Hub"""

    # ----- memory and speed -----
    local_rollout_forward_batch_size: int = 64
    """completions per generation / log-prob / scoring forward pass, per rank; 0: as many as fit in 90% of the
    memory free when each phase starts (GPU memory, or RAM on CPU), estimated from the model's config"""
    gradient_checkpointing: bool = False
    """recompute the policy's activations in the backward pass: less activation memory, a slower backward"""
    fsdp: bool = False
    """shard the policy's weights, gradients and optimizer state over the ranks with FSDP2 instead of replicating
    them with DDP; the reference and reward models stay replicated"""
    fsdp_generation: Literal["unshard", "per_block"] = "unshard"
    """with --fsdp, how the rollout sees the sharded policy. unshard: every block gathered once per update
    (fast). per_block: each block gathered at each forward, decoding steps included (least memory)"""
    offload: bool = False
    """with --fsdp: the policy's fp32 weight shards, gradients and AdamW state (stepped on the CPU) and the frozen
    models live in CPU memory, each brought to the GPU for its forward passes only; slower"""
    compile_generation: bool = False
    """decode with a torch.compile'd step (CUDA graphs on GPU) in a KV cache kept per chunk size: no
    per-token Python or kernel-launch overhead. The first update compiles, once per chunk size"""
    share_prompt: tyro.conf.DisallowNone[Optional[bool]] = None
    """compute each prompt once per forward pass for its k completions, each computed exactly as alone. Default:
    on for each model that can and passes a start-up check, else off with one line saying why"""
    bf16_generation: bool = False
    """with --bf16 (not --fsdp): sample from a bf16 copy of the policy, refreshed after every update, with a
    bf16 KV cache: faster decoding for 2 more bytes per parameter"""

    # ----- LoRA adapters -----
    use_peft: bool = False
    """train LoRA adapters (peft) on the frozen base; the reference is the same module with the adapters switched off
    (no second copy). Checkpoints and the final policy hold the adapter in peft's format"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scaling: the adapters' update is multiplied by lora_alpha / lora_r"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input, in training forward passes only; 0 (TRL: 0.05), so that the policy
    trained is the one that sampled"""
    lora_target_modules: Optional[tuple[str, ...]] = None
    """module names to adapt, or `all-linear`; None: peft's default for the architecture (attention projections,
    e.g. q_proj and v_proj for Llama, query_key_value for GPT-NeoX)"""
    lora_modules_to_save: Optional[tuple[str, ...]] = None
    """modules trained in full beside the adapters and saved with them (e.g. lm_head)"""
    use_rslora: bool = False
    """rank-stabilized LoRA: the adapters' update is scaled by lora_alpha / sqrt(lora_r) (peft's use_rslora)"""
    use_dora: bool = False
    """weight-decomposed LoRA (DoRA, peft's use_dora): a trained magnitude per output beside the adapters"""
    merge_lora: bool = False
    """with --use_peft: also write the base with the adapters merged in, in transformers' format (fp32), to
    output_dir/merged at the end (with --load_in_4bit: the 4-bit base dequantized to fp32, the function trained)"""
    load_in_4bit: bool = False
    """QLoRA: with --use_peft, the base (which is also the reference) is quantized to 4 bits by bitsandbytes at load
    time; the adapters train in fp32 on it. The reward model stays as --bf16 says"""
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    """the 4-bit data type of --load_in_4bit"""
    use_bnb_nested_quant: bool = False
    """with --load_in_4bit: quantize the quantization constants too (double quantization, ~0.4 bits per weight less)"""

    # ----- samples and evaluation -----
    num_sample_generations: int = 10
    """times per run a table of query / response / score is printed (and logged to wandb)"""
    logging_steps: int = 1
    """the console line every this many updates (metrics.jsonl and wandb get every update's metrics); with --max_steps,
    optimizer steps, as TRL >= 0.22 counts (update_intervals)"""
    num_evals: int = 4
    """evaluations on --dataset_test_split, spread evenly over the run, the last at its end; plus one of the initial
    policy before the first update (not repeated on resume)"""
    eval_max_prompts: int = 256
    """test prompts per evaluation (all ranks together)"""

    # ----- checkpoints and faults -----
    save_steps: int = 0
    """write a resumable checkpoint to output_dir/checkpoints/step_<update> every this many updates (TRL <= 0.21's
    unit; with --max_steps, optimizer steps, TRL >= 0.22's: update_intervals) (0: only at the end, or on a signal)"""
    save_strategy: Literal["steps", "no"] = "steps"
    """steps: a checkpoint every --save_steps updates; no: none but the last one (as TRL's `no`, with --save_steps 0)"""
    save_total_limit: Optional[int] = None
    """keep only the newest this many checkpoints (at least 1; the newest is never deleted); None keeps all"""
    resume: bool = False
    """continue from the newest intact checkpoint in output_dir if there is one (else start fresh: one command
    serves the first launch and every requeue); damaged newer ones are named and set aside"""
    resume_from: Optional[str] = None
    """continue from this checkpoint directory; later checkpoints of output_dir are set aside (another timeline)"""
    overwrite_output_dir: bool = False
    """start a new run in an output_dir that holds another run's files: those files (and only those: see
    docs/checkpoints-and-faults.md) are moved to output_dir/abandoned/ first, nothing is deleted. Without it such a
    run is refused"""
    allow_changed_inputs: tuple[str, ...] = ()
    """on --resume, inputs that may differ from those the run started with (by flag name: model_name_or_path,
    sft_model_path, reward_model_path, dataset_name, dataset_test_split, reward_fn); any other change is refused"""
    ddp_timeout: float = 600.0
    """seconds a rank waits for the others (in a collective, or after scoring, evaluation or a save) before the
    run stops with a line naming the late rank and its phase: a reward function that never returns, a dead node"""
    reward_fn_timeout: Optional[float] = None
    """seconds a reward function's call may take, then the run stops as if it raised; < --ddp_timeout; None: half"""


def is_finite_number(x) -> bool:
    """A number float32 holds as a finite value (not None, nan or inf)."""
    return x is not None and abs(x) <= FLOAT32_MAX  # nan too


def number_rules(args) -> list[tuple[str, object, bool, str]]:
    """(flag, value, whether it is allowed, what it must be) for every number of the run's flags (RunArgs, InputArgs)
    a typo or a NaN makes meaningless without any error later; the algorithm's are rloo.algorithm_rules."""
    finite = is_finite_number
    a = args
    return [
        ("reward_weights", a.reward_weights, all(finite(w) for w in a.reward_weights or ()), "finite numbers"),
        ("seed", a.seed, 0 <= a.seed < 2**31, "between 0 and 2**31 - 1 (numpy's seeds are unsigned)"),
        ("max_prompt_length", a.max_prompt_length, a.max_prompt_length >= 1, "at least 1"),
        ("local_rollout_forward_batch_size", a.local_rollout_forward_batch_size,
         a.local_rollout_forward_batch_size >= 0, ">= 0 (0: sized to the free memory)"),
        ("num_sample_generations", a.num_sample_generations, a.num_sample_generations >= 0, ">= 0 (0: none)"),
        ("num_evals", a.num_evals, a.num_evals >= 0, ">= 0 (0: only at the end)"),
        ("eval_max_prompts", a.eval_max_prompts, a.eval_max_prompts >= 1, "at least 1"),
        ("logging_steps", a.logging_steps, a.logging_steps >= 1, "at least 1"),
        ("save_steps", a.save_steps, a.save_steps >= 0, ">= 0 (0: only at the end and on a signal)"),
        ("save_total_limit", a.save_total_limit, a.save_total_limit is None or a.save_total_limit >= 1,
         "at least 1, or None to keep every checkpoint"),
        ("ddp_timeout", a.ddp_timeout, finite(a.ddp_timeout) and a.ddp_timeout > 0, "a finite number of seconds > 0"),
        ("reward_fn_timeout", a.reward_fn_timeout, a.reward_fn_timeout is None or (
            finite(a.reward_fn_timeout) and 0 < a.reward_fn_timeout < a.ddp_timeout),
         f"a number of seconds > 0 and below --ddp_timeout ({a.ddp_timeout:g}; raise it too), or None"),
    ]


def validate_args(args) -> None:
    """Refuse flags that clash before anything is loaded."""
    if args.model_name_or_path is None and args.sft_model_path is None:
        raise ConfigError("no policy: pass --model_name_or_path (and --sft_model_path if the weights live elsewhere)")
    if args.reward_model_path is None and not args.reward_fn:
        raise ConfigError("no reward: pass --reward_model_path and/or --reward_fn package.module:function")
    num_sources = int(args.reward_model_path is not None) + len(args.reward_fn)
    if args.reward_weights is not None and len(args.reward_weights) != num_sources:
        raise ConfigError(
            f"--reward_weights has {len(args.reward_weights)} values but there are {num_sources} reward sources "
            "(the reward model first, then each --reward_fn)"
        )
    for name, value, allowed, requirement in number_rules(args):
        if not allowed:
            raise ConfigError(f"{name} = {value!r} must be {requirement}")
    args.check_algorithm()  # the algorithm's own flags: rloo.algorithm_checks, beside its Args
    if args.overwrite_output_dir and args.resume:
        raise ConfigError("--overwrite_output_dir starts over, --resume continues: pass one of them")
    if args.save_strategy == "no" and args.save_steps:
        raise ConfigError(f"--save_strategy no but --save_steps {args.save_steps}: drop one of them")
    if args.compile_generation and args.fsdp:
        raise ConfigError("--compile_generation cannot trace FSDP's gathers of a sharded policy yet: drop one of "
                          "--compile_generation and --fsdp")
    if args.bf16_generation and (not args.bf16 or args.fsdp):
        raise ConfigError("--bf16_generation samples from a bf16 copy of a replicated policy: it needs --bf16, and not "
                          "--fsdp (whose gathered weights are bf16 already with --bf16)")
    if args.offload and not args.fsdp:
        raise ConfigError("--offload works through FSDP2's CPU offload: add --fsdp (under torchrun; "
                          "--nproc_per_node 1 for one GPU)")
    # ----- LoRA (--use_peft) -----
    if args.use_peft:
        if args.fsdp:
            raise ConfigError("--use_peft with --fsdp is not supported yet: the adapters' base is not sharded; drop "
                              "--fsdp (LoRA's states are small: DDP replicates them)")
        if args.lora_r < 1 or args.lora_alpha <= 0 or not 0 <= args.lora_dropout < 1:
            raise ConfigError(f"--lora_r {args.lora_r}, --lora_alpha {args.lora_alpha}, --lora_dropout "
                              f"{args.lora_dropout}: the rank must be >= 1, alpha > 0 and dropout in [0, 1)")
    elif args.merge_lora:
        raise ConfigError("--merge_lora merges LoRA adapters into the base: add --use_peft")
    elif args.load_in_4bit:
        raise ConfigError("--load_in_4bit quantizes a base that LoRA adapters train on (QLoRA), and a 4-bit model "
                          "cannot train itself: add --use_peft")
    elif args.use_rslora or args.use_dora:
        raise ConfigError(f"--{'use_rslora' if args.use_rslora else 'use_dora'} is a kind of LoRA adapter: add "
                          "--use_peft")
    if args.load_in_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("--load_in_4bit quantizes the base with bitsandbytes, which is not installed: pip "
                              "install bitsandbytes (or drop the flag)")
        if args.bf16_generation:
            raise ConfigError("--bf16_generation samples from a bf16 copy of the policy, but a --load_in_4bit base "
                              "is 4-bit: drop --bf16_generation (the 4-bit base samples as it trains)")
    elif args.bnb_4bit_quant_type != "nf4" or args.use_bnb_nested_quant:
        raise ConfigError(f"--{'use_bnb_nested_quant' if args.use_bnb_nested_quant else 'bnb_4bit_quant_type'} is "
                          "an option of the 4-bit base: add --load_in_4bit (with --use_peft)")
    if args.fsdp and "RANK" not in os.environ:
        raise ConfigError("--fsdp shards the policy over torchrun's processes: launch with torchrun")
    check_model_options(args)


def update_intervals(args, steps_per_update: int) -> tuple[int, int]:
    """--save_steps and --logging_steps in updates. They count updates, as in TRL <= 0.21, whose names the flags keep;
    but a command that sets the run's length with --max_steps counts in optimizer steps, as TRL >= 0.22's Trainer
    does (an update is num_ppo_epochs x num_mini_batches of them), and so do its --save_steps and --logging_steps
    (a checkpoint needs a whole update: a multiple of it; a console line comes at the first update that reaches
    the step)."""
    if args.max_steps is None:
        return args.save_steps, args.logging_steps
    if args.save_steps % steps_per_update:
        raise ConfigError(f"--save_steps {args.save_steps} counts optimizer steps with --max_steps (TRL >= 0.22's "
                          f"unit), and a checkpoint comes after a whole update of {steps_per_update} steps "
                          f"(num_ppo_epochs x num_mini_batches): pass a multiple of {steps_per_update}")
    return args.save_steps // steps_per_update, math.ceil(args.logging_steps / steps_per_update)


NO_4D_MASK = ("takes no 4D mask, and rloo.py's grouped rows (each prompt computed once for its k completions, in "
              "every forward pass) need one")
ATTENTION_REFUSED = {  # transformers' attention implementations that rloo.py cannot run, and why
    "flash_attention_2": NO_4D_MASK,
    "flash_attention_3": NO_4D_MASK,
    "flex_attention": "builds its own block mask from the mask it is given, and rloo.py's grouped rows crashed "
                      "it (heap corruption, torch 2.13 on CPU): a crash the start-up check of prompt sharing cannot "
                      "turn into a note",
    "paged_attention": "is for transformers' continuous batching; rloo.py samples with its own KV-cache loop",
}


def check_model_options(args) -> None:
    """--attn_implementation and --model_revision, before anything loads."""
    implementation = args.attn_implementation
    if implementation is not None and implementation not in ("sdpa", "eager"):
        why = ATTENTION_REFUSED.get(implementation.removeprefix("paged|"),
                                    "is a kernel from the Hub: code chosen by the network" if "/" in implementation
                                    else "is not one of transformers' attention implementations")
        raise ConfigError(f"--attn_implementation {implementation} {why}: pass sdpa or eager (or leave it out)")
    if not args.model_revision.strip():
        raise ConfigError("--model_revision is empty: pass a branch, tag or commit of the policy on the Hub, or leave "
                          "it out (main)")
    if args.model_revision != "main":
        for flag in ("model_name_or_path", "sft_model_path"):
            path = getattr(args, flag)
            if path is not None and Path(path).exists():
                raise ConfigError(f"--model_revision {args.model_revision} names a Hub revision, but --{flag} {path} "
                                  "is a local path, which has no revisions (transformers would ignore it): check "
                                  "the revision out there, or download it (hf download MODEL --revision R "
                                  "--local-dir DIR), and drop --model_revision")
        if args.reward_model_path is not None and not Path(args.reward_model_path).exists():
            raise ConfigError(f"--model_revision {args.model_revision} pins the policy's revision; TRL loads a reward "
                              f"model named by Hub id ({args.reward_model_path}) at that revision too, this project "
                              "does not: download the reward model's revision (hf download MODEL --revision R "
                              "--local-dir DIR) and pass --reward_model_path DIR")


def quantization_config(args):
    """transformers' BitsAndBytesConfig of --load_in_4bit (TRL's get_quantization_config), None without it. The
    adapters compute in fp32, as the base's other weights are (--bf16 autocasts both)."""
    if not args.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    # bitsandbytes' import, on a CPU with AVX512-BF16, fetches a kernel from the Hub and runs it where the `kernels`
    # package is installed: code chosen by the network. Blocked (it falls back to its own kernels), whatever is
    # installed, and so is its warning that the kernel is missing
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    blocked, sys.modules["kernels"] = sys.modules.get("kernels"), None
    try:
        importlib.import_module("bitsandbytes")
    finally:
        if blocked is None:
            del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = blocked

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=args.use_bnb_nested_quant,
                              bnb_4bit_compute_dtype=torch.float32)


def policy_options(args) -> dict:
    """from_pretrained's arguments for the policy's base (TRL's model_init_kwargs): its revision, attention and
    4-bit quantization."""
    options = {"revision": args.model_revision, "attn_implementation": args.attn_implementation}
    return options | ({"quantization_config": quantization_config(args)} if args.load_in_4bit else {})


# ===================================================================== distributed: ranks, FSDP2, all-reduce
@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_distributed(timeout: float = 1800.0) -> Dist:
    """torch.distributed from torchrun's RANK/LOCAL_RANK/WORLD_SIZE: NCCL on GPUs, gloo on CPU; a collective that
    waits longer than `timeout` seconds for another rank fails instead of waiting on (so does wait_for_peers: the
    process group's store has the same timeout)."""
    if "RANK" not in os.environ:  # plain `python rloo.py`
        return Dist(0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if torch.cuda.is_available():
        gpus, ranks_here = torch.cuda.device_count(), os.environ.get("LOCAL_WORLD_SIZE", "?")
        if local_rank >= gpus:
            raise ConfigError(f"{ranks_here} ranks on this node but {gpus} GPU(s) visible: one rank per GPU, so launch "
                              f"with --nproc_per_node {gpus}; for a CPU (gloo) run, set CUDA_VISIBLE_DEVICES=")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # gloo too on GPUs: collectives on CPU tensors (--offload's gradient shards, their norm) have a backend
    dist.init_process_group(backend="cuda:nccl,cpu:gloo" if backend == "nccl" else backend,
                            timeout=datetime.timedelta(seconds=timeout))
    return Dist(rank, local_rank, world_size, device)


def shard_policy(policy, bf16: bool, offload: bool = False):
    """FSDP2 over all ranks: one unit per transformer block (the classes in the model's `_no_split_modules`), the
    embeddings and head in the root unit. fp32 master weights; bf16 compute with --bf16; gradients reduced in fp32
    (they sum log-prob gradients over thousands of tokens). With `offload` the shards, their gradients and so the
    optimizer state stay in CPU memory; a unit's weights visit the GPU while it computes."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    block_classes = set(getattr(policy, "_no_split_modules", None) or ())
    blocks = [m for m in policy.modules() if type(m).__name__ in block_classes]
    if not blocks:
        raise ConfigError(f"--fsdp: {type(policy).__name__} names no transformer block class (_no_split_modules) "
                          "to shard by; drop --fsdp to replicate it with DDP")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    placement = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mp_policy=mp, offload_policy=placement)
    fully_shard(policy, mp_policy=mp, offload_policy=placement)
    if not reduce_scatter_averages(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        # FSDP2 averages fp32 gradients with ReduceOp.AVG; where that sums, have it sum and divide itself
        units = [m for m in policy.modules() if is_fsdp_unit(m)]
        if not hasattr(policy, "set_force_sum_reduction_for_comms"):
            raise ConfigError(f"--fsdp: this torch's {dist.get_backend()} reduce-scatter sums where FSDP2 asks it "
                              "to average, and this FSDP2 cannot work around it: use torch >= 2.8")
        for unit in units:
            unit.set_force_sum_reduction_for_comms(True)
    return policy


def reduce_scatter_averages(device: torch.device) -> bool:
    """Whether ReduceOp.AVG averages in this process group's reduce-scatter. gloo in torch 2.7 and 2.8 silently
    sums instead (NCCL averages)."""
    out = torch.zeros(1, device=device)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # the newer name
    reduce_scatter(out, torch.ones(dist.get_world_size(), device=device), op=dist.ReduceOp.AVG)
    return out.item() == 1.0


@contextlib.contextmanager
def visiting(model, device: torch.device):
    """A frozen model kept in CPU memory (--offload) comes to `device` for one phase's forward passes and goes back
    after; a model already there (or None) stays where it is."""
    home = next(model.parameters()).device if model is not None else device
    if home == device:
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to(home)


def is_fsdp_unit(module) -> bool:
    """isinstance(module, FSDPModule), without importing FSDP2 in runs that never shard: until something imports
    it, nothing can be one."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


@contextlib.contextmanager
def gathered_for_rollout(policy, mode: str):
    """For sampling and evaluation with an FSDP policy. mode "unshard": every block's weights are gathered at its
    first forward and kept for the whole block of code, not gathered again at each decoding step. On exit every
    unit is resharded, the root too: a forward pass without backward leaves the root's weights gathered, and the
    parameters then registered on the module are not the ones the optimizer holds. Without FSDP, nothing."""
    blocks = [m for m in policy.modules() if is_fsdp_unit(m) and m is not policy] \
        if mode == "unshard" else []
    if blocks and not hasattr(blocks[0], "set_reshard_after_forward"):
        raise ConfigError("--fsdp_generation unshard needs FSDPModule.set_reshard_after_forward (torch >= 2.8): "
                          "upgrade torch, or pass --fsdp_generation per_block")
    for block in blocks:
        block.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        reshard(policy)
        for block in blocks:
            block.set_reshard_after_forward(True, recurse=False)


def reshard(policy) -> None:
    """Every FSDP unit of the policy back to its shards: its parameters are the sharded ones again, which the
    optimizer holds (without FSDP, nothing)."""
    for unit in policy.modules():
        if is_fsdp_unit(unit):
            unit.reshard()


def unwrapped(model):
    """The module DDP wraps, or the model itself: what holds the config, the forward's signature and the weights."""
    return model.module if isinstance(model, DDP) else model


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce when distributed; identity in a single process."""
    if dist.is_initialized():
        dist.all_reduce(x, op=op)
    return x


def global_mean_std(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (unbiased) std of the masked entries of x over all ranks."""
    mask = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
    x = x.float() * mask
    moments = all_reduce(torch.stack([x.sum(), (x * x).sum(), mask.sum().float()]))  # (3,)
    total, total_sq, count = moments
    mean = total / count
    var = (total_sq - count * mean * mean) / (count - 1).clamp(min=1)
    return mean, var.clamp(min=0).sqrt()


# ===================================================================== data files, with one-line diagnostics
PROMPT_IDS = "prompt_input_ids"  # the tokenized prompt column this script adds to the dataset


def pad_sequences(
    sequences: list[list[int]], pad_id: int, device: torch.device, side: Literal["left", "right"] = "left"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists into (ids, mask), both (N, T_max). Queries are left-padded: generation continues from
    the right edge."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        span = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, span], mask[i, span] = torch.tensor(s, dtype=torch.long), True
    return ids.to(device), mask.to(device)


LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


DATA_FIX = "pass a .jsonl/.json/.parquet file (UTF-8) or a save_to_disk directory with a prompt column of strings"


def load_split(name: str, split: str, config: Optional[str]):
    """A dataset split from a local file, a `save_to_disk` directory or the Hub; whatever reading it raises is one
    line naming it (reading)."""
    with reading(f"dataset {name} (split {split!r})", DATA_FIX):
        return _load_split(name, split, config)


def _load_split(name: str, split: str, config: Optional[str]):
    import datasets

    path = Path(name)
    if path.suffix in LOCAL_FORMATS:
        return load_local_file(path)
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"dataset directory {name} is not a dataset written by save_to_disk "
                              f"({first_line(e)}); pass such a directory or a .jsonl/.json/.parquet file") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"dataset {name} has no split {split!r}; its splits are {list(loaded)}")
            return loaded[split]
        return loaded
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # the Hub client raises many types; the user needs the first line of any
        raise ConfigError(
            f"could not load dataset {name!r} (split {split!r}) from the Hugging Face Hub: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} - without network, pass a local "
            ".jsonl/.json/.parquet file or a save_to_disk directory"
        ) from None


def first_line(e: BaseException) -> str:
    """An exception's message in one line, for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def has_splits(name: str) -> bool:
    """Whether the dataset has named splits: a Hub dataset or a saved DatasetDict does, a single file or a saved
    Dataset does not (any split name would silently give the whole of it)."""
    path = Path(name)
    if path.suffix in LOCAL_FORMATS:
        return False
    return not path.is_dir() or (path / "dataset_dict.json").is_file()


def load_local_file(path: Path):
    """A .jsonl/.json/.parquet file as one dataset; a file that cannot be read is named with its first bad line."""
    import datasets

    if not path.is_file():
        raise ConfigError(f"dataset file {path} does not exist")
    if path.stat().st_size == 0:
        raise ConfigError(f"dataset file {path} is empty")
    problem = not_utf8(path) if path.suffix in (".jsonl", ".json") else None  # pyarrow takes such bytes unchecked
    if problem:
        raise ConfigError(f"dataset file {path} cannot be read: {problem}: re-encode it as UTF-8 "
                          "(e.g. iconv -f latin1 -t utf-8)")
    problem = bad_json_line(path)
    if problem:
        raise ConfigError(f"dataset file {path} cannot be read: {problem}")
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # it logs its own copy of a parse error first
    try:
        dataset = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    except Exception as e:  # pyarrow's and datasets' many types; the line that is wrong is what the user needs
        raise ConfigError(f"dataset file {path} cannot be read: {bad_json_line(path) or describe(e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if len(dataset) == 0:
        raise ConfigError(f"dataset file {path} has no rows")
    return dataset


def not_utf8(path: Path, chunk: int = 1 << 20) -> Optional[str]:
    """`line N is not UTF-8 text (...)` for the first bytes of the file that are not UTF-8, else None; read in
    chunks by the codec (C speed, constant memory)."""
    import codecs

    decoder, lines = codecs.getincrementaldecoder("utf-8")(), 1
    with path.open("rb") as f:
        while True:
            data = f.read(chunk)
            pending = decoder.getstate()[0]  # a character cut by the chunk's end: its first bytes
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:  # e.start counts from the pending bytes
                seen = pending + data
                line = lines + seen[:e.start].count(b"\n")
                return f"line {line} is not UTF-8 text (byte {seen[e.start:e.start + 1]!r})"
            if not data:
                return None
            lines += data.count(b"\n")


def bad_json_line(path: Path) -> Optional[str]:
    """`line N: what is wrong` for the first line of a JSON-lines file that is not a JSON object (or for a .json
    file that is not JSON, or a list holding something else than objects); None when every line is. Checked before
    datasets reads the file: some files of JSON values that are not objects crash its reader (a segmentation fault,
    datasets 4 with pyarrow 22), which no except clause catches."""
    if path.suffix not in (".jsonl", ".json"):
        return None
    text = path.read_text(encoding="utf-8-sig", errors="replace")  # a byte-order mark is read, as datasets does
    lines = text.split("\n")  # not splitlines(): JSON strings may hold U+2028 and its kin
    if path.suffix == ".json":
        try:
            whole = json.loads(text)
            if isinstance(whole, list):
                item = next((i for i, row in enumerate(whole) if not isinstance(row, dict)), None)
                return None if item is None else (f"item {item} of its top-level list is a JSON "
                                                  f"{type(whole[item]).__name__}, not an object with a prompt column")
            return None if isinstance(whole, dict) else (f"it holds a JSON {type(whole).__name__}, not a list of "
                                                         "objects with a prompt column")
        except json.JSONDecodeError as whole:
            try:  # JSON lines under a .json name have a valid first line
                json.loads(next((line for line in lines if line.strip()), ""))
            except json.JSONDecodeError:
                return f"line {whole.lineno} is not valid JSON ({whole.msg}, column {whole.colno})"
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {number} is not valid JSON ({e.msg}, column {e.colno})"
        if not isinstance(row, dict):
            return f"line {number} is a JSON {type(row).__name__}, not an object with a prompt column"
    return None


def is_prompt(value) -> bool:
    """A prompt is a string, or chat messages: a list of {"role": ..., "content": ...} dicts."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "content" in m for m in value)


def check_prompt_values(rows: dict, indices: list[int], prompt_column: str, name: str) -> None:
    """Refuse, naming the first offending row of a batch, prompts that are neither strings nor chat messages (None,
    numbers) and pre-tokenized queries that are not lists of token ids."""
    if prompt_column in rows:
        column, valid, what = prompt_column, is_prompt, "a string or a list of chat messages"
    else:
        column, what = "query_token", "a list of token ids"
        valid = lambda ids: isinstance(ids, list) and all(isinstance(t, int) for t in ids)  # noqa: E731
    for row, value in zip(indices, rows[column]):
        if not valid(value):
            raise ConfigError(f"dataset {name}, row {row}: column {column!r} holds {repr(value)[:60]}, not {what}")


def describe_dropped(dropped: dict[str, int], max_prompt_length: int) -> str:
    return (f"{dropped['too_long']} dropped as longer than {max_prompt_length} tokens"
            + (f", {dropped['empty']} empty" if dropped["empty"] else ""))


def describe_prompt_lengths(dropped: dict[str, int], max_prompt_length: int) -> str:
    """Tokens per prompt before any was dropped: a tokenizer that does not fit the prompts shows here."""
    return (f"tokens per prompt min {dropped['min_tokens']} / median {dropped['median_tokens']} / max "
            f"{dropped['max_tokens']}; {describe_dropped(dropped, max_prompt_length)}")


@contextlib.contextmanager
def startup_step(what: str, announce: bool):
    """Rank 0 (`announce`) says what a set-up step did and its time: `what in T s`, then the lines the block adds
    to the list it gets."""
    details: list[str] = []
    start = time.perf_counter()
    yield details
    if announce:
        print(f"{what} in {time.perf_counter() - start:.1f} s" + "".join(f"; {d}" for d in details), flush=True)


def prepare_prompts(dataset, tokenizer, prompt_column: str, max_prompt_length: int, name: str,
                    vocab_size: Optional[int], prompt_token_ids: Callable):
    """Add the PROMPT_IDS column (prompt_token_ids(rows, tokenizer, prompt_column)), drop empty prompts and prompts
    longer than max_prompt_length. Returns (dataset, dropped), dropped = {"empty": count, "too_long": count}. With
    `vocab_size`, token ids the policy cannot embed are refused (a tokenizer of another model, pre-tokenized ids of
    another vocabulary). Whatever reading the rows raises is one line naming the dataset (reading)."""
    with reading(f"dataset {name}", DATA_FIX):
        return _prepare_prompts(dataset, tokenizer, prompt_column, max_prompt_length, name, vocab_size,
                                prompt_token_ids)


def _prepare_prompts(dataset, tokenizer, prompt_column: str, max_prompt_length: int, name: str,
                     vocab_size: Optional[int], prompt_token_ids: Callable):
    import pyarrow.compute as pc

    if prompt_column not in dataset.column_names and "query_token" not in dataset.column_names:
        raise ConfigError(
            f"dataset {name} has no {prompt_column!r} column (string or chat messages) and no pre-tokenized "
            f"'query_token' column; its columns are {dataset.column_names}: pass --prompt_column NAME"
        )

    def tokenize(rows: dict, indices: list[int]) -> dict:
        check_prompt_values(rows, indices, prompt_column, name)
        return {PROMPT_IDS: prompt_token_ids(rows, tokenizer, prompt_column)}

    # in memory: no cache files for torchrun's ranks to race on
    dataset = dataset.map(tokenize, with_indices=True, batched=True, keep_in_memory=True)
    ids = dataset.with_format("arrow")[PROMPT_IDS]  # lengths and extremes in Arrow: no Python list per token
    lowest, highest = pc.min_max(pc.list_flatten(ids)).values()
    if vocab_size is not None and lowest.is_valid and not 0 <= lowest.as_py() <= highest.as_py() < vocab_size:
        row, bad = next((i, t) for i, row_ids in enumerate(dataset[PROMPT_IDS]) for t in row_ids
                        if not 0 <= t < vocab_size)
        raise ConfigError(f"dataset {name}, row {row}: token id {bad} is outside the policy's vocabulary of "
                          f"{vocab_size}: tokenize with the policy's tokenizer")
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
    dropped = {"empty": int((lengths == 0).sum()), "too_long": int((lengths > max_prompt_length).sum()),
               "min_tokens": int(lengths.min()), "median_tokens": int(np.median(lengths)),
               "max_tokens": int(lengths.max())}
    dataset = dataset.select(np.flatnonzero((lengths > 0) & (lengths <= max_prompt_length)), keep_in_memory=True)
    if len(dataset) == 0:
        raise ConfigError(f"every prompt of {name} is empty or longer than max_prompt_length ({max_prompt_length})")
    return dataset, dropped


def load_prompts(args, tokenizer, vocab_size: Optional[int], prompt_token_ids: Callable):
    """Train prompts tokenized by prompt_token_ids, test prompts (None without --dataset_test_split), and how many
    were dropped (see prepare_prompts)."""
    test_is_file = args.dataset_test_split is not None and Path(args.dataset_test_split).suffix in LOCAL_FORMATS
    for flag, split in (("--dataset_train_split", args.dataset_train_split), ("--dataset_test_split",
                                                                               args.dataset_test_split)):
        if split not in (None, "train") and not (flag == "--dataset_test_split" and test_is_file) \
                and not has_splits(args.dataset_name):
            fix = "pass the test prompts as a file: --dataset_test_split test.jsonl" \
                if flag == "--dataset_test_split" else f"drop {flag}"
            raise ConfigError(f"{flag} {split}: dataset {args.dataset_name} has no splits (a single file or saved "
                              f"Dataset is one split, whatever its name); {fix}")
    dataset = load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    dataset, dropped = prepare_prompts(dataset, tokenizer, args.prompt_column, args.max_prompt_length,
                                       args.dataset_name, vocab_size, prompt_token_ids)
    eval_dataset = None
    if args.dataset_test_split is not None:
        source = args.dataset_test_split if test_is_file else args.dataset_name
        eval_dataset, _ = prepare_prompts(load_split(source, args.dataset_test_split, args.dataset_config),
                                          tokenizer, args.prompt_column, args.max_prompt_length, source, vocab_size,
                                          prompt_token_ids)
    return dataset, eval_dataset, dropped


# ===================================================================== models: files, kernels, LoRA, sharing, caches
@contextlib.contextmanager
def transformers_quiet():
    """transformers' warnings unprinted (its errors still raise)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _from_pretrained(loader: Callable, path: str, what: str, **kwargs):
    """loader(path, **kwargs), the one boundary of a model, tokenizer or config (reading): whatever it raises is one
    line naming it. transformers' load report is not printed: newly_initialized says what matters in it."""
    with transformers_quiet(), reading(f"could not load {what} from {path!r}",
                                       "without network, pass a local directory written by save_pretrained"):
        return loader(path, **kwargs)


def newly_initialized(loaded: tuple, what: str, path: str, fix: str):
    """The model of from_pretrained(..., output_loading_info=True), refused in one line when weights its class needs
    are not in its files (transformers would initialize them at random; tied weights are not missing)."""
    model, info = loaded
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(f"{what} {path!r} lacks weights its {type(model).__name__} needs ({shown}): they would be "
                          f"newly initialized at random; {fix}")
    return model


def ensure_pad_token(tokenizer, pad_token: Optional[str], embedding_rows: int, name: str) -> None:
    """Give the tokenizer a pad token that the model can embed, or refuse with the fix."""
    if tokenizer.pad_token_id is not None:
        return
    if pad_token is None:
        raise ConfigError(
            f"the tokenizer of {name} has no pad token: save one with a pad token, or pass --pad_token TOKEN"
        )
    tokenizer.add_special_tokens({"pad_token": pad_token})
    if tokenizer.pad_token_id >= embedding_rows:
        raise ConfigError(
            f"the tokenizer of {name} has no pad token, and adding {pad_token!r} gives id {tokenizer.pad_token_id}, "
            f"outside the model's {embedding_rows}-row embedding: save a tokenizer with a pad token (resizing "
            "the embeddings) or pass --pad_token with a token the tokenizer already has"
        )


def load_config(path: str, what: str, trust_remote_code: bool, revision: str = "main"):
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig.from_pretrained, path, what, trust_remote_code=trust_remote_code,
                            revision=revision)


REWARD_MODEL_FIX = ("pass a reward model trained and saved as an AutoModelForSequenceClassification with num_labels=1, "
                    "or score with --reward_fn")
POLICY_FIX = "pass a causal LM saved by save_pretrained (an AutoModelForCausalLM with its lm_head)"


def check_reward_model_config(path: str, trust_remote_code: bool) -> None:
    """A saved classification head must give one score per sequence (a causal LM gets a new one-label head)."""
    config = load_config(path, "reward model", trust_remote_code)
    classifier = any(name.endswith("ForSequenceClassification") for name in config.architectures or ())
    causal = [name for name in config.architectures or () if name.endswith(("ForCausalLM", "LMHeadModel"))]
    if causal and not classifier:
        raise ConfigError(f"reward model {path!r} is a {causal[0]}, not a reward model: its score head would be "
                          f"newly initialized, random scores; {REWARD_MODEL_FIX}")
    if classifier and config.num_labels != 1:
        raise ConfigError(f"reward model {path!r} has a {config.num_labels}-label classification head, but a reward is "
                          "one number per completion: use a reward model saved with num_labels=1")


def same_vocabulary(a, b) -> bool:
    """True when token ids mean the same text in both tokenizers (each one's pad token aside)."""
    vocab_a = {t: i for t, i in a.get_vocab().items() if t != a.pad_token}
    vocab_b = {t: i for t, i in b.get_vocab().items() if t != b.pad_token}
    return vocab_a == vocab_b


def choose_kernels() -> None:
    """TF32 matmuls, and no cuDNN attention: it builds an execution plan for every new sequence length, and a
    batch's padded length changes with its prompts (measured on an H100, pythia-1b shape, TL;DR-like lengths: the
    same work took 2.1-7.0 s per update with it, 2.0-2.2 s without). SDPA's flash and memory-efficient kernels
    take its place."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(False)


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's names, as transformers' save_pretrained writes an adapter


ADAPTER_CONFIG = "adapter_config.json"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(path: str, trust_remote_code: bool, revision: str = "main"):
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from the config alone, which makes every prompt empty
        raise ConfigError(f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:3])}, ...): save the "
                          "model's tokenizer there (tokenizer.save_pretrained(path))")
    return _from_pretrained(
        AutoTokenizer.from_pretrained, path, "tokenizer", padding_side="left", trust_remote_code=trust_remote_code,
        revision=revision)


def load_causal_lm(path: str, dtype: torch.dtype, trust_remote_code: bool, weights: Optional[Path] = None,
                   revision: str = "main", **options):
    """The model at `path` (at that Hub revision); with `weights` (a checkpoint), only its weights, in safetensors,
    come from there: the architecture and any remote code still come from `path`, so that a checkpoint can choose no
    code to run. `options`: from_pretrained's (policy_options: attention, quantization)."""
    from transformers import AutoModelForCausalLM

    if weights is None:
        model = newly_initialized(_from_pretrained(
            AutoModelForCausalLM.from_pretrained, path, "policy", dtype=dtype, trust_remote_code=trust_remote_code,
            revision=revision, output_loading_info=True, **options), "policy", path, POLICY_FIX)
    else:
        config = load_config(path, "policy", trust_remote_code, revision)
        with torch.device("meta"):  # the class only: nothing allocated
            model_class = type(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))
        model = newly_initialized(_from_pretrained(
            model_class.from_pretrained, str(weights), "policy", config=config, dtype=dtype, use_safetensors=True,
            output_loading_info=True, **options), "checkpoint", str(weights),
            "resume from an intact checkpoint (--resume_from)")
    for module in model.modules():  # bitsandbytes' 4-bit layers: on a CPU with AVX512-BF16 a forward without
        if hasattr(module, "support_avx512bf16_for_cpu"):  # gradient repacks the weights for a bf16 kernel, so
            module.support_avx512bf16_for_cpu = False  # the sampler would see another base than the trainer
    return model


def load_reward_model(path: str, dtype: torch.dtype, trust_remote_code: bool,
                      attn_implementation: Optional[str] = None):
    from transformers import AutoModelForSequenceClassification

    model = newly_initialized(_from_pretrained(
        AutoModelForSequenceClassification.from_pretrained,
        path,
        "reward model",
        num_labels=1,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
        output_loading_info=True,
    ), "reward model", path, REWARD_MODEL_FIX)
    if not hasattr(model, "score"):
        raise ConfigError(f"reward model {path!r} has no `score` head; use an AutoModelForSequenceClassification model")
    return model


def stop_token_id_of(args, tokenizer, tokenizer_path: str) -> Optional[int]:
    """--stop_token_id, or the tokenizer's EOS with --stop_token eos, or None."""
    if args.stop_token_id is not None or args.stop_token != "eos":
        return args.stop_token_id
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"--stop_token eos but the tokenizer of {tokenizer_path} has no EOS: pass --stop_token_id")
    return tokenizer.eos_token_id


def prepare_tokenizer(args):
    """The policy's tokenizer with a pad token, and the policy's vocabulary size (None if its config does not say),
    checked from the models' configs before any weights load: the pad and stop token ids fit the vocabulary, the
    reward model's head gives one score."""
    tokenizer_path = args.model_name_or_path or args.sft_model_path
    tokenizer = load_tokenizer(tokenizer_path, args.trust_remote_code, args.model_revision)
    config = load_config(args.sft_model_path or args.model_name_or_path, "policy", args.trust_remote_code,
                         args.model_revision)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size is not None:
        ensure_pad_token(tokenizer, args.pad_token, vocab_size, tokenizer_path)
        stop_token_id = stop_token_id_of(args, tokenizer, tokenizer_path)
        if stop_token_id is not None and stop_token_id >= vocab_size:
            raise ConfigError(f"stop_token_id = {stop_token_id} is outside the policy's vocabulary of {vocab_size}: "
                              "pass an id below it")
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions and args.max_prompt_length + args.response_length > positions and os.environ.get("RANK", "0") == "0":
        print(f"rloo.py: warning: max_prompt_length + response_length = {args.max_prompt_length + args.response_length}"
              f" tokens exceed the policy's {positions} positions (max_position_embeddings): longer prompts would "
              "fail or degrade; lower --max_prompt_length", file=sys.stderr)
    if args.reward_model_path is not None:
        check_reward_model_config(args.reward_model_path, args.trust_remote_code)
    return tokenizer, vocab_size


def save_merged_policy(args, config, tokenizer) -> None:
    """--merge_lora: the base with output_dir's final adapter merged in by peft (a fresh fp32 copy of the base, in
    CPU memory), in transformers' format with the tokenizer, at output_dir/merged; loads without peft. A
    --load_in_4bit base is quantized again and dequantized to fp32 (exactly the 4-bit weights), so that the merged
    model computes what trained: merging into the original weights would drop the quantization the adapters saw."""
    from peft import PeftModel

    merged_dir = Path(args.output_dir) / MERGED
    base = load_causal_lm(args.sft_model_path or args.model_name_or_path, torch.float32, args.trust_remote_code,
                          **policy_options(args))
    if args.load_in_4bit:
        with transformers_quiet():  # its note that it dequantizes: what was asked for
            base = base.dequantize()
    merged = PeftModel.from_pretrained(base, args.output_dir).merge_and_unload()
    merged.config.pad_token_id = config.pad_token_id
    try:
        merged.save_pretrained(merged_dir)
        tokenizer.save_pretrained(merged_dir)
        weights_readable_as_the_rest(merged_dir)
    except WRITE_ERRORS as e:
        raise Fault(f"could not write the merged policy to {merged_dir}: {first_line(e)}; the adapter in "
                    f"{args.output_dir} is intact: merge it with peft's merge_and_unload") from e


def lora_config(args):
    """peft's LoraConfig from the --lora_* flags (TRL's ModelConfig names; one target name is passed as a string,
    as TRL does, so that `all-linear` means every linear layer)."""
    from peft import LoraConfig

    targets = args.lora_target_modules
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
                      use_rslora=args.use_rslora, use_dora=args.use_dora,
                      target_modules=targets[0] if targets and len(targets) == 1 else targets and list(targets),
                      modules_to_save=args.lora_modules_to_save and list(args.lora_modules_to_save))


def add_adapters(policy, args, checkpoint: Optional[Path]) -> None:
    """LoRA adapters injected into the policy's own modules by peft (through transformers' add_adapter, so that
    the policy keeps its class, config and forward), fp32 like the base's master weights (--bf16 autocasts them as
    it does the base); only they require grad. Initialized from --seed, or read from the checkpoint's adapter."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    with torch.random.fork_rng(devices=[]):  # the same initial adapter on every rank, from --seed alone
        torch.manual_seed(args.seed)
        try:
            policy.add_adapter(lora_config(args))
        except ValueError as e:  # no target modules known for the architecture, or a name that matches nothing
            raise ConfigError(f"--use_peft: {first_line(e)} - pass --lora_target_modules (module names, or "
                              "all-linear)") from None
    base = policy.peft_config["default"].base_model_name_or_path  # the path as typed; a Hub id stays as it is
    if base and Path(base).is_dir():  # absolute: the saved adapter loads its base from any folder
        policy.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    if checkpoint is None:
        return
    prefix = "base_model.model."  # what peft's format prepends to the model's own parameter names
    saved = {name.removeprefix(prefix): value for name, value in load_file(checkpoint / ADAPTER_WEIGHTS).items()}
    expected = policy.get_adapter_state_dict()
    if saved.keys() != expected.keys() or any(saved[n].shape != expected[n].shape for n in saved):
        raise ConfigError(f"cannot resume: the adapter in {checkpoint} does not match --lora_* ({len(saved)} tensors "
                          f"for {len(expected)}): resume with the checkpoint's run's flags")
    set_peft_model_state_dict(policy, saved, adapter_name="default")


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


def disable_dropout(model: torch.nn.Module) -> None:
    """RL needs the sampling policy and the trained policy to be the same function."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def peft_layers(model) -> list[torch.nn.Module]:
    """The modules peft put adapters (or trained copies, --lora_modules_to_save) in."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


class AdaptersOff(torch.nn.Module):
    """The frozen reference of a LoRA policy: the policy itself called with its adapters switched off, without
    gradient, so the base's weights are never copied. It holds no weights of its own: the policy is not a submodule
    (.to(), .train(), state_dict() never reach it), parameters() are the policy's (where `visiting` looks for
    them), and every other attribute, the config and the backbone included, is the policy's. Its forward takes
    what the policy's forward takes."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self._policy = (policy,)  # in a tuple: not registered as a submodule
        self.forward = functools.wraps(policy.forward)(functools.partial(AdaptersOff._forward, self))  # its signature

    def _forward(self, *args, **kwargs):
        policy = self._policy[0]
        layers = peft_layers(policy)
        with torch.no_grad():
            for layer in layers:
                layer.enable_adapters(False)
            try:
                return policy(*args, **kwargs)
            finally:  # back on, trainable again (peft's enable_adapters sets requires_grad as it was)
                for layer in layers:
                    layer.enable_adapters(True)

    def parameters(self, recurse: bool = True):
        return self._policy[0].parameters(recurse)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_policy":
                raise
            return getattr(self._policy[0], name)


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


def why_not_shared(model) -> Optional[str]:
    """Why prompt groups cannot be fed to the model as one row each (None: they can): its attention must take a 4D
    mask as it is (transformers' sdpa and eager attention do; flash-attention and remote code may not), explicit
    positions, and every layer must be attention."""
    module = unwrapped(model)
    config = getattr(module, "config", None)
    if attention_implementation(model) not in ("sdpa", "eager"):
        return f"its attention ({attention_implementation(model)}) may not take a custom 4D mask"
    if "position_ids" not in inspect.signature(module.forward).parameters:
        return "its forward takes no position_ids"
    if attention_windows(model) is None:
        kinds = sorted(set(config.layer_types) - {"full_attention", "sliding_attention"})
        return f"its {'/'.join(kinds)} layers read the whole row in order, so responses would see each other"
    return None


SHARING_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}  # by the weights' dtype


PROBE_TOKENS = (24, 8)  # the probe's longest prompt and response where no sliding window asks for longer rows


def probe_lengths(max_prompt_length: int, response_length: int, *models) -> tuple[int, int]:
    """The probe's longest prompt and response: rows no longer than the check needs, never longer than training's.
    What a grouped row can get wrong that one row per completion gets right is which tokens each token sees (its
    mask) and at which position; the head reads each position on its own. Without a sliding window that shows in
    rows of any length: a prompt of PROBE_TOKENS[0] tokens (left-padded beside one a third as long) and responses of
    PROBE_TOKENS[1] and about half as many, side by side. A window W shows only in rows longer than it: where
    training's rows can pass it, the prompt is W + 1 tokens (at most training's longest) and the responses are
    training's, so that the grouped rows pass it too."""
    windows = [w for model in models if model is not None
               for w in (attention_windows(model) or {}).values() if w is not None]
    if any(w < max_prompt_length + 2 * response_length for w in windows):
        return min(max_prompt_length, max(PROBE_TOKENS[0], max(windows) + 1)), response_length
    return min(max_prompt_length, PROBE_TOKENS[0]), min(response_length, PROBE_TOKENS[1])


def sharing_probe(prompt_ids: list[int], max_prompt_length: int, response_length: int,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """What the start-up check computes both ways, as rloo.Completions' fields: two prompts (max_prompt_length tokens
    and a third as many, left-padded; probe_lengths says how long the check needs) with two responses each
    (response_length tokens and about half as many, side by side in a group), their tokens drawn from a train
    prompt's by a fixed generator."""
    generator = torch.Generator().manual_seed(0)
    pool = torch.tensor(prompt_ids)

    def draw(n: int) -> torch.Tensor:
        return pool[torch.randint(len(pool), (n,), generator=generator)]

    queries, query_mask = pad_sequences([draw(n).tolist() for n in (max_prompt_length, max(1, max_prompt_length // 3))],
                                        0, device)  # (2, Tq) each
    long, short = response_length, response_length // 2 + 1
    lengths = torch.tensor([long, short, short, long])  # (k*g,), k = g = 2: each group one of each
    response_mask = torch.arange(response_length) < lengths[:, None]  # (k*g, Tr)
    responses = draw(4 * response_length).view(4, response_length).masked_fill(~response_mask, 0)
    return {"queries": queries, "query_mask": query_mask, "responses": responses.to(device),
            "response_mask": response_mask.to(device)}


@torch.no_grad()
def sharing_error(model, probe, compute: Callable) -> float:
    """The largest difference between compute(group, share) (the probe's log-probs of its response tokens, or a reward
    model's scores) on grouped rows (share True) and on one row per completion, one prompt group at a time, in the
    weights' dtype, where the model's weights are."""
    device = next(model.parameters()).device
    probe = probe.map_tensors(lambda t: t.to(device), lambda t: t.to(device))
    groups = [probe.of_prompts(torch.tensor([i], device=device)) for i in range(probe.queries.shape[0])]
    return max(float((compute(group, True).float() - compute(group, False).float()).abs().max()) for group in groups)


HEAD_CONFIG_KEYS = {"architectures", "num_labels", "id2label", "label2id", "problem_type", "tie_word_embeddings",
                    "_name_or_path", "transformers_version", "dtype", "torch_dtype"}


def sharing_key(model) -> tuple:
    """What the start-up check's verdict depends on: the backbone's code and config (its head's keys left out: a
    head reads each position's hidden state on its own), attention implementation, adapters, dtype and device. A
    policy and a reward model with one key share one check: the grouped rows pass through the same backbone code."""
    module = unwrapped(model)
    config = {key: value for key, value in module.config.to_dict().items() if key not in HEAD_CONFIG_KEYS}
    parameter = next(module.parameters())
    return (type(getattr(module, module.base_model_prefix, module)).__qualname__, json.dumps(config, sort_keys=True,
            default=str), attention_implementation(model), bool(getattr(module, "_hf_peft_config_loaded", False)),
            parameter.dtype, parameter.device)


def shares_prompts(model, name: str, requested: Optional[bool], probe, compute: Callable, notes: list[str],
                   checked: Optional[dict] = None) -> bool:
    """Whether `model` computes each prompt group as one row (--share_prompt: `requested`, None by default): where
    it can (why_not_shared) and the start-up check (sharing_error: `compute` on the probe's grouped rows against one
    row per completion) is within SHARING_TOLERANCE, so that an architecture nobody tested cannot train on wrong
    gradients. Else a note says why (a ConfigError where --share_prompt asked for it). `checked` ({sharing_key:
    verdict}) carries one model's check to the next where their keys agree (a policy and its reward model of one
    architecture and dtype): the check runs once for both."""
    if requested is False:
        return False
    key = sharing_key(model)
    if checked is not None and key in checked:
        why = checked[key]
    else:
        why = why_not_shared(model)
        if why is None:
            tolerance = SHARING_TOLERANCE.get(next(model.parameters()).dtype, 5e-2)
            try:
                difference = sharing_error(model, probe, compute)
                if not difference <= tolerance:  # NaN fails too
                    why = (f"the start-up check found its grouped rows' results {difference:.2g} away from one row "
                           f"per completion's (tolerance {tolerance:g})")
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # an attention that cannot take the grouped rows at all
                why = f"its forward fails on grouped rows ({first_line(e)})"
        if checked is not None:
            checked[key] = why
    if why is None:
        return True
    if requested:
        raise ConfigError(f"--share_prompt: the {name} cannot share prompts exactly: {why}; "
                          "leave the flag out (it then computes one row per completion)")
    notes.append(f"prompt sharing is off for the {name}: {why}; it computes one row per completion")
    return False


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


@dataclass
class RewardSources:
    """Everything that scores completions: a reward model (with its tokenizer) and reward functions."""

    model: Optional[torch.nn.Module]
    model_tokenizer: Optional[object]  # None when the policy's token ids can be fed as they are
    functions: list[tuple[str, Callable]]
    weights: torch.Tensor  # (S,)
    share_prompt: bool = False  # the reward model reads a prompt group as one row (grouped_rows)
    timeout: Optional[float] = None  # seconds a reward function's call may take (--reward_fn_timeout)

    @property
    def names(self) -> list[str]:
        return (["reward_model"] if self.model is not None else []) + [name for name, _ in self.functions]


def load_reward_sources(args, tokenizer, functions: list[tuple[str, Callable]], device: torch.device):
    """The reward model (frozen, with its own tokenizer when the vocabularies differ) and the reward functions."""
    model, model_tokenizer = None, None
    if args.reward_model_path is not None:
        seed_everything(args.seed)  # a head missing from the checkpoint starts alike on every rank and resume
        model = load_reward_model(args.reward_model_path, torch.bfloat16 if args.bf16 else torch.float32,
                                  args.trust_remote_code, args.attn_implementation)
        disable_dropout(model)
        model = model.to("cpu" if args.offload else device).eval().requires_grad_(False)
        try:
            own_tokenizer = load_tokenizer(args.reward_model_path, args.trust_remote_code)
        except ConfigError:  # no tokenizer saved with the reward model: it shares the policy's
            own_tokenizer = tokenizer
        model_tokenizer = None if same_vocabulary(own_tokenizer, tokenizer) else own_tokenizer
    num_sources = int(model is not None) + len(functions)
    return RewardSources(model, model_tokenizer, functions, torch.tensor(args.reward_weights or [1.0] * num_sources),
                         timeout=args.reward_fn_timeout or args.ddp_timeout / 2)


def bf16_copy(policy):
    """A frozen bf16 copy of the policy to sample from (--bf16_generation)."""
    return copy.deepcopy(policy).to(torch.bfloat16).eval().requires_grad_(False)


@torch.no_grad()
def copy_weights(source, target) -> None:
    """target's parameters := source's, cast to target's dtype (the same module structure)."""
    for to, value in zip(target.parameters(), source.parameters(), strict=True):
        to.copy_(value)


# ===================================================================== faults: rollout source, reward functions, NaN
class RolloutSourceError(Exception):
    """The completions of an update cannot be had (an engine died): the run checkpoints and stops."""


REWARD_FUNCTION_ARGUMENTS = ("prompts", "completions", "completion_ids")  # and every other dataset column


class RewardFunctionError(Fault):
    """A reward function raised, hung or returned something that is not one number (or None) per completion. The run
    keeps the last finished update (a checkpoint) and stops; `after_training`: the update in progress had trained
    already (the failure was in its evaluation). `signal_name`: no failure, a stop signal came while a reward
    function ran (stop_signals_at_once): the same checkpoint, then the exit of a signal."""

    def __init__(self, message: str, announce: bool = True, after_training: bool = False,
                 signal_name: Optional[str] = None):
        super().__init__(message, announce)
        self.after_training, self.signal_name = after_training, signal_name


def load_reward_functions(specs: tuple[str, ...]) -> list[tuple[str, Callable]]:
    """Import each `package.module:function` spec; each must take **kwargs (it is called with every column)."""
    functions = []
    # the directory the command runs in, as `python -m` has it: `python path/to/rloo.py` puts only the script's own
    # directory first on sys.path. Last, so that a file there never shadows an installed package
    if specs and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"--reward_fn {spec!r} is not of the form package.module:function")
        cwd = os.getcwd()
        try:
            module = importlib.import_module(module_name)
            if os.getcwd() != cwd:  # relative paths (output_dir, data files) would now point elsewhere
                os.chdir(cwd)
                raise ConfigError(f"reward function {spec!r}: importing {module_name!r} changed the working "
                                  "directory: give it absolute paths instead of os.chdir")
        except ConfigError:
            raise
        except ImportError as e:
            top = module_name.split(".")[0]
            if e.name is not None and e.name != module_name and not module_name.startswith(e.name + "."):
                raise ConfigError(f"reward function {spec!r}: importing {module_name!r} failed: it imports "
                                  f"{e.name!r}, which is not installed ({first_line(e)})") from None
            where = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
            raise ConfigError(f"unknown reward function {spec!r}: cannot import {module_name!r} ({e}); looked in the "
                              f"working directory {os.getcwd()}, PYTHONPATH ({where or 'unset'}) and the installed "
                              f"packages: run from the folder that holds {top}.py (or the package {top}/), or add "
                              f"that folder to PYTHONPATH") from None
        except (Exception, SystemExit) as e:  # a SyntaxError, anything the module's own code raises
            raise ConfigError(f"reward function {spec!r}: importing {module_name!r} failed with {type(e).__name__}: "
                              f"{first_line(e)}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ConfigError(f"unknown reward function {spec!r}: module {module_name!r} has no function {attr!r}")
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        if inspect.Parameter.VAR_KEYWORD not in kinds:
            raise ConfigError(f"reward function {spec!r} takes no **kwargs: it is called with prompts, completions, "
                              "completion_ids and every other dataset column as keywords; add **kwargs")
        functions.append((attr, fn))
    return functions


def check_reward_function_arguments(functions: list[tuple[str, Callable]], splits: list[tuple[str, object]],
                                    prompt_column: str) -> None:
    """Each parameter a reward function requires must be one it is given, for each (name, dataset) of `splits`
    (None: absent): a fixed argument, or a column other than the prompt's (given as `prompts`)."""
    for dataset_name, dataset in splits:
        columns = [] if dataset is None else [c for c in dataset.column_names if c not in (PROMPT_IDS, prompt_column)]
        for name, fn in functions if dataset is not None else ():
            for parameter in inspect.signature(fn).parameters.values():
                required = parameter.default is inspect.Parameter.empty and parameter.kind in (
                    inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                if required and parameter.name not in (*REWARD_FUNCTION_ARGUMENTS, *columns):
                    raise ConfigError(f"reward function {name!r} needs {parameter.name!r}, which is neither one of "
                                      f"{list(REWARD_FUNCTION_ARGUMENTS)} nor a column of dataset {dataset_name} (its "
                                      f"columns: {columns})")


def is_number(value) -> bool:
    """A Python, numpy or 0-d tensor/array number."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    return isinstance(value, numbers.Real)


def call_reward_function(name: str, fn: Callable, n: int, timeout: Optional[float] = None, /,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (n,) and an applies-mask (n,) from a reward function returning a number or None per completion.
    Whatever it raises (SystemExit included), anything else it returns, a value outside float32's range, and not
    returning within `timeout` seconds become a RewardFunctionError naming it. It runs in a thread of its own while
    this one waits, so that neither a function stuck in C code or a sleep nor its own `except` clauses can keep a
    stop signal from acting (stop_signals_at_once); it gets its own copies of the arguments to change as it likes."""
    kwargs, outcome = copy.deepcopy(kwargs), {}
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # both are per thread
    grad_enabled = torch.is_grad_enabled()

    def call() -> None:
        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            with torch.set_grad_enabled(grad_enabled):
                outcome["out"] = fn(**kwargs)
        except BaseException as e:  # the user's code: any type, sys.exit included
            outcome["error"] = e

    thread = threading.Thread(target=call, name=f"reward function {name}", daemon=True)  # abandoned if it hangs
    cwd = os.getcwd()
    with stop_signals_at_once():
        thread.start()
        thread.join(timeout)
    if os.getcwd() != cwd:  # relative paths (output_dir) would now point elsewhere
        os.chdir(cwd)
        raise RewardFunctionError(f"reward function {name!r} changed the working directory: give it absolute paths "
                                  "instead of os.chdir")
    if thread.is_alive():
        raise RewardFunctionError(f"reward function {name!r} did not return within --reward_fn_timeout {timeout:g} s")
    if "error" in outcome:
        e = outcome["error"]
        raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {first_line(e)}") from e
    try:  # the boundary of what it returns: whatever reading it raises is one line naming the function
        return reward_values(name, outcome["out"], n)
    except RewardFunctionError:
        raise
    except Exception as e:  # a value whose __len__, __iter__ or __float__ raises, an int beyond a float, ...
        raise RewardFunctionError(f"reward function {name!r} returned values that cannot be read as numbers "
                                  f"({describe(e)}): return a list of {n} floats (or None), one per completion") \
            from None


def reward_values(name: str, out, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (n,) and an applies-mask (n,) of a reward function's return value `out`; anything but a number (bool
    as 0/1) or None per completion, or a value beyond float32, is a RewardFunctionError."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise RewardFunctionError(f"reward function {name!r} returned {repr(out)[:80]}, not a list of {n} numbers "
                                  "(or None), one per completion")
    out = list(out)
    if len(out) != n:
        raise RewardFunctionError(f"reward function {name!r} returned {len(out)} values for {n} completions: it must "
                                  "return one number (or None) per completion")
    for i, v in enumerate(out):
        if v is None:
            continue
        if not is_number(v):
            raise RewardFunctionError(f"reward function {name!r} returned {repr(v)[:80]} ({type(v).__name__}) "
                                      "among its values: each must be a number or None")
        value = v.item() if hasattr(v, "item") else v
        if isinstance(value, numbers.Integral) and abs(value) > FLOAT32_MAX:  # float() of it may overflow
            shown = f"an int of {int(value).bit_length()} bits"
        elif not abs(float(value)) <= FLOAT32_MAX:  # nan and inf too
            shown = repr(float(value))
        else:
            continue
        raise RewardFunctionError(f"reward function {name!r} returned {shown} for completion {i}: each value must "
                                  f"be a finite float32 (at most {FLOAT32_MAX:.4g} in magnitude)")
    applies = torch.tensor([v is not None for v in out])
    return torch.tensor([0.0 if v is None else float(v) for v in out]), applies


class NonFiniteError(Exception):
    """A NaN or inf in a quantity that training would otherwise use; raised on every rank at once."""

    def __init__(self, quantity: str, ranks: list[int], unwritten: Optional[str] = None):
        super().__init__(f"non-finite {quantity} on rank {', '.join(map(str, ranks))}")
        self.quantity, self.ranks = quantity, ranks
        self.unwritten = unwritten  # why the offending batch could not be written (a full disk), if it could not


def check_finite(named: dict[str, Optional[torch.Tensor]], device: torch.device) -> None:
    """Collective: every rank learns whether any rank holds a NaN/inf in one of the named tensors, so that all
    of them stop together instead of the healthy ones waiting forever in the next collective."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    bad = torch.zeros(len(named), world_size, device=device)  # (quantities, ranks)
    for i, value in enumerate(named.values()):
        if value is not None and not torch.isfinite(value).all():
            bad[i, rank] = 1.0
    all_reduce(bad)
    for (name, _), ranks in zip(named.items(), bad):
        if ranks.any():
            raise NonFiniteError(name, ranks.nonzero().flatten().tolist())


def dump_batch(path: Path, tokenizer, rollout, scores: torch.Tensor,
               advantages: Optional[torch.Tensor]) -> None:
    """One JSON line per completion of the offending batch: prompt, completion, score, advantage and log-prob sum
    (null where the update had not computed them yet)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    num_prompts = rollout.queries.shape[0]
    with open(path, "w") as f:
        for i in range(len(scores)):
            prompt = rollout.queries[i % num_prompts][rollout.query_mask[i % num_prompts]]
            completion = rollout.responses[i][rollout.response_mask[i]]
            f.write(json.dumps({
                "prompt": tokenizer.decode(prompt), "completion": tokenizer.decode(completion),
                "score": scores[i].item(), "advantage": None if advantages is None else advantages[i].sum().item(),
                "logprob_sum": None if rollout.logprobs is None else rollout.logprobs[i].sum().item(),
            }) + "\n")


@contextlib.contextmanager
def batch_kept_if_nonfinite(output_dir: str, update: int, rank: int, tokenizer, rollout, scores: torch.Tensor):
    """For the training step: a NaN/inf (NonFiniteError, on every rank at once) stops the run before any optimizer
    step on it, the ranks that hold it writing the offending batch to output_dir/nonfinite/ first."""
    try:
        yield
    except NonFiniteError as e:
        unwritten = None
        if rank in e.ranks:
            try:
                dump_batch(Path(output_dir) / "nonfinite" / f"update_{update}_rank_{rank}.jsonl", tokenizer, rollout,
                           scores, rollout.advantages)
            except OSError as error:  # a full disk: the run stops all the same, and says the batch is not there
                unwritten = error.strerror or str(error)
        raise NonFiniteError(f"{e.quantity} at update {update}", e.ranks, unwritten) from None


# ===================================================================== measuring: phase times, work, memory
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


def mismatch_metrics(rollout, args, importance_weights: Callable, cliprange: float,
                     cliprange_high: float) -> dict[str, float]:
    """How far the sampler's log-probs of its tokens are from the trainer's (the PPO ratio's denominator), for one
    rank's (k*B, Tr) rollout: per valid token, and as the sequence ratio p_trainer / p_sampler (the importance
    weight that --vllm_importance_sampling_correction truncates with rloo.importance_weights); mismatch/clipfrac: the
    share outside the loss's clip band [1 - cliprange, 1 + cliprange_high]."""
    mask = rollout.response_mask
    diff = (rollout.logprobs - rollout.sampler_logprobs).double() * mask  # (k*B, Tr)
    ratio = diff.sum(1).exp()  # (k*B,)
    out = {"mismatch/logprob_diff_mean": (diff.abs().sum() / mask.sum().clamp(min=1)).item(),
           "mismatch/logprob_diff_max": diff.abs().max().item(),
           "mismatch/ratio_mean": ratio.mean().item(),
           "mismatch/ratio_std": ratio.std().item() if ratio.numel() > 1 else 0.0,
           "mismatch/clipfrac": ((ratio < 1 - cliprange) | (ratio > 1 + cliprange_high)).double().mean().item()}
    if args.vllm_importance_sampling_correction:
        weights = importance_weights(rollout.logprobs.double(), rollout.sampler_logprobs.double(), mask,
                                     args.vllm_importance_sampling_mode, args.vllm_importance_sampling_cap)
        raw = ratio if weights.dim() == 1 else diff.exp()  # (k*B,) or (k*B, Tr)
        counted = torch.ones_like(weights) if weights.dim() == 1 else mask.double()  # the weights that act
        n = counted.sum().clamp(min=1)
        out["mismatch/is_weight_mean"] = ((weights * counted).sum() / n).item()
        out["mismatch/is_capped_frac"] = (((raw > args.vllm_importance_sampling_cap) * counted).sum() / n).item()
    return out


# ===================================================================== logging: console, metrics.jsonl, wandb, curves
SUM_METRICS = ("val/num_eos_tokens", "completions/masked_truncated")


MIN_METRICS = ("completions/min_length", "clip_ratio/low_min")


MAX_METRICS = ("completions/max_length", "mismatch/logprob_diff_max", "clip_ratio/high_max")


MISMATCH_WARNING = 0.05  # mismatch/clipfrac above which the log says so, once a run


def is_optional_metric(key: str, value: float) -> bool:
    """A reward source's mean is NaN on a rank where the source applied to no completion: no data, not a
    failure. Every other NaN is reported as NaN, never hidden."""
    return key.startswith("reward/") and math.isnan(value)


def reduce_metrics(metrics: dict[str, float], device: torch.device,
                   max_metrics: tuple[str, ...] = ()) -> dict[str, float]:
    """Metrics over all ranks: sums for counts, min/max for extremes and peak memory, means for everything else
    (a mean over the ranks that have data, for optional metrics); also the maximum of `max_metrics` (the rollout
    source's). Every rank must pass the same keys."""
    keys = sorted(metrics)
    # peak memory: the fullest rank's
    maxima = [k for k in keys if k in MAX_METRICS + max_metrics or k.startswith("memory/")]
    means = [k for k in keys if k not in SUM_METRICS + MIN_METRICS + tuple(maxima)]
    has_data = [0.0 if is_optional_metric(k, metrics[k]) else 1.0 for k in means]
    values = [metrics[k] if w else 0.0 for k, w in zip(means, has_data)]
    sums = all_reduce(torch.tensor(values + has_data + [metrics[k] for k in SUM_METRICS if k in metrics],
                                   dtype=torch.float64, device=device))
    out = {k: sums[i].item() / sums[len(means) + i].item() for i, k in enumerate(means) if sums[len(means) + i] > 0}
    out.update({k: v.item() for k, v in zip([k for k in SUM_METRICS if k in metrics], sums[2 * len(means):])})
    for op, selected in ((dist.ReduceOp.MIN, [k for k in MIN_METRICS if k in metrics]), (dist.ReduceOp.MAX, maxima)):
        extremes = all_reduce(torch.tensor([metrics[k] for k in selected], dtype=torch.float64, device=device), op)
        out.update(zip(selected, extremes.tolist()))
    return out


def completion_metrics(response_mask: torch.Tensor, has_stop: torch.Tensor, scores: torch.Tensor, k: int) -> dict:
    """Length and spread statistics of one rank's (N, Tr) completions (TRL's names; a rank with no completion that
    stopped has mean_terminated_length 0, as TRL logs it)."""
    lengths = response_mask.sum(1).float()  # (N,)
    per_prompt_std = scores.reshape(k, -1).std(0)  # (B,)
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/mean_terminated_length": lengths[has_stop].mean().item() if has_stop.any() else 0.0,
        "completions/clipped_ratio": (~has_stop).float().mean().item(),
        "val/num_eos_tokens": has_stop.sum().item(),
        "reward_std": per_prompt_std.mean().item(),
        "frac_reward_zero_std": (per_prompt_std < 1e-6).float().mean().item(),
    }


def read_metrics(path, evals: bool = False) -> list[dict]:
    """The lines of a metrics.jsonl: the per-update lines (they hold `objective/scores`), or with `evals` the
    evaluation lines (they hold `eval/scores`; update 0 is the initial policy's)."""
    if not Path(path).is_file():  # a device or a pipe (metrics.jsonl made a link to /dev/full) may never end
        raise OSError(f"{path} is not a regular file")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if ("eval/scores" if evals else "objective/scores") in row]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    chunks = [values[max(0, i - window + 1) : i + 1] for i in range(len(values))]
    return [sum(chunk) / len(chunk) for chunk in chunks]


def score_sources(rows: list[dict]) -> str:
    """What a run's score is: its reward sources, read from their `reward/<source>/mean` metrics."""
    names = dict.fromkeys(key[len("reward/"):-len("/mean")] for row in rows for key in row
                          if key.startswith("reward/") and key.endswith("/mean"))
    return ", ".join(name.replace("_", " ") if name == "reward_model" else f"{name}()" for name in names) or "score"


def curve_panels(runs: list[tuple[list[dict], list[dict]]]) -> list[tuple[str, str, bool]]:
    """(metric, title, from eval lines) of each panel drawn for these runs' (update lines, eval lines): score,
    RLHF reward, KL, the eval score where a run evaluated, the sampler/trainer mismatch where it was logged."""
    sources = score_sources([row for rows, _ in runs for row in rows])
    panels = [("objective/scores", f"score ({sources})", False),
              ("objective/rlhf_reward", "RLHF reward (score - KL penalty)", False),
              ("objective/kl", "KL(policy || reference)", False)]
    if any(evals for _, evals in runs):
        panels.append(("eval/scores", f"eval score ({sources}; test prompts, near-greedy)", True))
    if any("mismatch/logprob_diff_mean" in row for rows, _ in runs for row in rows):
        panels.append(("mismatch/logprob_diff_mean", "sampler/trainer |log-prob difference| per token", False))
    return panels


def plot_curves(metrics_paths: list[Path] | Path, png_path: Path, smooth: int = 10) -> None:
    """One panel per metric against episode, one line per metrics.jsonl (its directory's name); per-update values
    faint, a `smooth`-update trailing mean solid; eval scores as points. Written whole (a viewer never sees half)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state; Agg draws the file

    metrics_paths = [metrics_paths] if isinstance(metrics_paths, (str, Path)) else list(metrics_paths)
    runs = [(read_metrics(path), read_metrics(path, evals=True)) for path in metrics_paths]
    panels = curve_panels(runs)
    fig = Figure(figsize=(4.6 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for path, (rows, evals) in zip(metrics_paths, runs):
        color = None
        for ax, (key, title, from_evals) in zip(axes, panels):
            points = [(row["episode"], row[key]) for row in (evals if from_evals else rows) if key in row]
            if not points:
                continue
            episodes, values = zip(*points)
            if from_evals:
                (line,) = ax.plot(episodes, values, marker="o", color=color, label=Path(path).parent.name)
            else:
                (line,) = ax.plot(episodes, moving_average(list(values), smooth), color=color,
                                  label=Path(path).parent.name)
                ax.plot(episodes, values, color=line.get_color(), alpha=0.25, linewidth=0.8)
            color = line.get_color()
    for ax, (_, title, _) in zip(axes, panels):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("episode")
        ax.xaxis.get_major_locator().set_params(nbins=4)  # labels of 5-6 digits side by side stay apart
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # nothing to name before the first update's line
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    partial = png_path.with_name(f".{png_path.name}.partial")
    fig.savefig(partial, dpi=100, format="png")
    os.replace(partial, png_path)


class CurvesSink:
    """Draws output_dir/curves.png from metrics.jsonl as the run goes: after an update at most once per
    CURVES_EVERY x the last drawing's time (so drawing stays a few percent of the run), after each evaluation and at
    the end. Plumbing that must never stop a run: without matplotlib, or when a drawing fails, one line, once, and
    no more drawing."""

    CURVES_EVERY = 20  # measured on 2 busy CPU cores: ~1 s for a 625-update run's curves, the first ~2 s (matplotlib's
    # import): drawn at most once per 20 s there, under 5% of the run

    def __init__(self, metrics_path: Path, say: Callable[[str], None]):
        self.metrics_path, self.png_path, self.say = metrics_path, metrics_path.with_name("curves.png"), say
        self.enabled, self.next_time = True, 0.0

    def draw(self, force: bool = False) -> None:
        if not self.enabled or (not force and time.perf_counter() < self.next_time):
            return
        start = time.perf_counter()
        try:
            plot_curves(self.metrics_path, self.png_path)
        except ImportError as e:
            self.enabled = False
            self.say(f"no curves.png: matplotlib cannot be imported ({first_line(e)}); pip install matplotlib")
        except Exception as e:  # noqa: BLE001: a drawing is never worth a run
            self.enabled = False
            self.say(f"warning: drawing {self.png_path} failed ({type(e).__name__}: {first_line(e)}); no more curves "
                     "this run (benchmark/plot_metrics.py draws them from metrics.jsonl)")
        end = time.perf_counter()
        self.next_time = end + self.CURVES_EVERY * (end - start)


class MetricsWriteError(Fault):
    """metrics.jsonl could not be written (a full disk, a quota): the run stops, with a checkpoint where it can."""


class RunLogger:
    """Rank 0's outputs: a compact line per update, metrics.jsonl (appended), wandb, a progress bar, tables."""

    LINE_KEYS = (("objective/scores", "score"), ("objective/rlhf_reward", "rlhf"), ("objective/kl", "kl"),
                 ("objective/entropy", "ent"), ("policy/clipfrac_avg", "clip"), ("completions/mean_length", "len"),
                 ("eps", "eps"))

    def __init__(self, args, run_name: str, num_updates: int, start_update: int, wandb_run_id: Optional[str],
                 run_id: Optional[str] = None, logging_steps: Optional[int] = None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        self.metrics_path = Path(args.output_dir) / "metrics.jsonl"
        open(self.metrics_path, "a").close()
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_name,
                       config=asdict(args), dir=args.output_dir, id=wandb_run_id, resume="allow")
        self.console = Console()
        self.progress = Progress(TextColumn("update"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 console=self.console, transient=True)
        self.task = self.progress.add_task("updates", total=num_updates, completed=start_update)
        self.progress.start()
        self.num_updates, self.logging_steps = num_updates, logging_steps or args.logging_steps  # in updates
        self.run_id = run_id  # on every metrics.jsonl line: a line of another run is never taken for this one's
        self.mismatch_warned = False
        self.curves = CurvesSink(self.metrics_path, lambda line: self.console.print(line, highlight=False,
                                                                                       soft_wrap=True))

    def log(self, update: int, metrics: dict[str, float]) -> None:
        self.write_metrics({"update": update, **metrics})
        if self.wandb is not None:
            self.wandb.log(metrics, step=int(metrics["episode"]))
        if update % self.logging_steps and update != self.num_updates:
            self.progress.advance(self.task)
            return
        parts = " ".join(f"{short} {metrics[key]:.0f}" if abs(metrics[key]) >= 100 else f"{short} {metrics[key]:.3g}"
                         for key, short in self.LINE_KEYS if key in metrics)
        phases = sorted(((v, k[5:]) for k, v in metrics.items() if k.startswith("time/") and k != "time/update"),
                        reverse=True)[:2]  # the update's two longest phases: metrics.jsonl has them all
        times = f" | {metrics['time/update']:.2f} s: " if "time/update" in metrics else " | "
        self.console.print(f"update {update}/{self.num_updates}, episode {int(metrics['episode'])}: {parts}{times}"
                           + ", ".join(f"{name} {v:.2f}" for v, name in phases), highlight=False, soft_wrap=True)
        if metrics.get("mismatch/clipfrac", 0.0) > MISMATCH_WARNING and not self.mismatch_warned:
            self.mismatch_warned = True
            self.console.print(
                f"warning: the sampler and the trainer disagree: {metrics['mismatch/clipfrac']:.0%} of completions "
                f"have p_trainer / p_sampler outside the clip band (per-token |log-prob difference| mean "
                f"{metrics['mismatch/logprob_diff_mean']:.2g}, max {metrics['mismatch/logprob_diff_max']:.2g}); see "
                "--vllm_importance_sampling_correction (said once a run)", highlight=False, soft_wrap=True)
        self.progress.advance(self.task)
        self.curves.draw()

    def log_eval(self, update: int, metrics: dict[str, float], episode: int) -> None:
        self.write_metrics({"update": update, "episode": episode, **metrics})
        if self.wandb is not None:
            self.wandb.log(metrics, step=episode)
        self.console.print(f"eval after update {update}: " + " ".join(f"{k.removeprefix('eval/')} {v:.4g}"
                                                                         for k, v in metrics.items()),
                           highlight=False, soft_wrap=True)
        self.curves.draw(force=update > 0)

    def write_metrics(self, record: dict) -> None:
        """One line of metrics.jsonl, whole or not at all: a write that fails (a full disk, a quota) is cut off again
        and stops the run (MetricsWriteError)."""
        size = self.metrics_path.stat().st_size
        try:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({**record, "run_id": self.run_id}) + "\n")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.truncate(self.metrics_path, size)
            raise MetricsWriteError(f"could not write {self.metrics_path} ({e.strerror or e})") from None

    def sample_table(self, rows: list[tuple[str, str, float]], episode: int) -> None:
        from rich.table import Table

        table = Table(title=f"samples at episode {episode}", show_lines=True)
        for column in ("query", "response", "score"):
            table.add_column(column)
        for query, response, score in rows:
            table.add_row(query, response, f"{score:.4f}")
        self.console.print(table)
        if self.wandb is not None:
            self.wandb.log({"samples": self.wandb.Table(columns=["query", "response", "score"],
                                                        data=[list(r) for r in rows])}, step=episode)

    @property
    def wandb_run_id(self) -> Optional[str]:
        return self.wandb.run.id if self.wandb is not None else None

    def close(self) -> None:
        self.progress.stop()
        self.curves.draw(force=True)
        if self.wandb is not None:
            self.wandb.finish()


# ===================================================================== stop signals and late ranks
CHECKPOINTS = "checkpoints"


STEP_DIR = re.compile(r"^step_(\d+)$")


TRAINER_STATE = "trainer_state.pt"


MANIFEST = "manifest.json"  # written last into a checkpoint: the size and sha256 of each of its other files


PREEMPTED = "preempted"  # in output_dir while a run stopped by a signal waits to be resumed; job scripts requeue on it


LOCK = "run.lock"  # flock'ed by the run that writes to output_dir, and holding its pid and host


ABANDONED = "abandoned"  # output_dir/abandoned/<time>_<why>/: work a run set aside (never deleted)


MERGED = "merged"  # output_dir/merged: --merge_lora's policy, written with the final one


RUN_OUTPUTS = (CHECKPOINTS, "metrics.jsonl*", "curves.png", PREEMPTED, "nonfinite", "wandb", LOCK,  # what a run
               ABANDONED, "engine_*.log", "engines.json")  # writes before it ends (the last two: rloo_multinode.py's)


class StartupInterrupted(BaseException):
    """A signal arrived before the first update: there is nothing to save, so the run ends at once. A
    BaseException, as KeyboardInterrupt is, so that library code's `except Exception` lets it through."""

    def __init__(self, signal_name: str):
        super().__init__(f"{signal_name} received during start-up: stopped before the first update, nothing was "
                         "trained; run the same command again to start")
        self.signal_name = signal_name


class StopSignal:
    """SIGTERM and SIGUSR1 (what SLURM sends before preemption or the time limit) and SIGINT (Ctrl-C, and what
    many launchers send) ask the run to stop after the current update with a checkpoint; the handler only records
    the signal, the update loop decides when to act on it. After a first SIGINT, a second one kills the process at
    once (the default action, which works even inside a hung collective). Until `training` is set there is nothing
    to save: a signal ends the run at once (StartupInterrupted), SIGTERM and SIGUSR1 leaving the `preempted` marker
    so that a job script requeues the run."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, lock: "OutputDirLock", announce: bool):
        self.name: Optional[str] = None
        self.training = False
        self.at_once = False  # the main thread only waits for a reward function (stop_signals_at_once)
        self.lock = lock  # the run's output_dir, marked as preempted only by the run holding it
        self.announce = announce
        for sig in self.SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        name = signal.Signals(signum).name
        if not self.training:
            if signum != signal.SIGINT and self.lock.held:
                (Path(self.lock.output_dir) / PREEMPTED).write_text("stopped during start-up, before any update\n")
            raise StartupInterrupted(name)
        self.name = self.name or name
        if self.at_once:  # the function may never return: stop now, from the state at the start of the update
            raise RewardFunctionError(f"{name} received while a reward function ran", signal_name=name)
        if signum == signal.SIGINT and self.announce:  # os.write: print() is not safe inside a signal handler
            os.write(2, b"rloo.py: SIGINT received: stopping after this update with a checkpoint; Ctrl-C again "
                        b"exits at once without one\n")

    def requested(self, device: torch.device) -> bool:
        """Collective: True on every rank as soon as any rank got a signal."""
        return bool(all_reduce(torch.tensor([float(self.name is not None)], device=device), dist.ReduceOp.MAX).item())


@contextlib.contextmanager
def signals_held():
    """The stop signals are delivered only after the block: a move of several directories is never cut in half."""
    signal.pthread_sigmask(signal.SIG_BLOCK, StopSignal.SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, StopSignal.SIGNALS)


@contextlib.contextmanager
def stop_signals_at_once():
    """While the main thread only waits for a reward function (running in a thread of its own), a stop signal stops
    the run at once, raising there, instead of after the update: the function may be stuck for good."""
    stop = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if not isinstance(stop, StopSignal) or not stop.training or threading.current_thread() != threading.main_thread():
        yield
        return
    stop.at_once = True
    try:
        yield
    finally:
        stop.at_once = False


# ---- ranks waiting for each other: who is late, and where
def process_group_store():
    """The store of the ranks' process group (torchrun's rendezvous store, under a prefix of its own), where the
    ranks publish their phases and count their barriers. None in a single process, or in a torch whose
    ProcessGroup lacks get_group_store (older ones: plain barriers, no late rank named)."""
    if not dist.is_initialized() or not hasattr(dist.group.WORLD, "get_group_store"):
        return None
    return dist.group.WORLD.get_group_store()


def note_phase(name: str) -> None:
    """Record the phase this rank is in (with several ranks, in the store): a rank that waits too long for another
    can then say what that one is doing."""
    store = process_group_store()
    if store is not None:
        store.set(f"rloo/phase/{dist.get_rank()}", json.dumps([name, time.time()]))


def wait_for_peers(what: str) -> None:
    """A barrier of all ranks through the store, at most --ddp_timeout long. A rank that has not arrived by then
    (a reward function that never returns, a dead node) makes every waiting rank raise a Fault naming it and the
    phase it is in, said once by the lowest waiting rank; a collective would wait as long, then fail without
    saying which rank nor where. The wait times out as the collectives do: init_process_group gives the store
    their timeout."""
    store = process_group_store()
    if store is None:
        if dist.is_initialized():
            dist.barrier()
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    passed = store.add(f"rloo/barriers_of/{rank}", 1)  # every rank passes the same barriers in the same order
    key, waiting = f"rloo/barrier/{passed}", f"waiting for the other ranks after {what}"
    note_phase(waiting)
    if store.add(key, 1) == world:
        store.set(f"{key}/all", "1")
    try:
        store.wait([f"{key}/all"])
    except RuntimeError:  # DistStoreError: the wait timed out
        now, phases = time.time(), {}
        for r in range(world):
            phases[r] = json.loads(store.get(f"rloo/phase/{r}")) if store.check([f"rloo/phase/{r}"]) \
                else ["start-up", None]
        late = [r for r in range(world) if phases[r][0] != waiting]
        where = "; ".join(f"rank {r} is in {phases[r][0]!r}" + (f" since {now - phases[r][1]:.0f} s" if phases[r][1]
                                                                  else "") for r in late)
        waited = store.timeout.total_seconds()
        raise Fault(f"the other ranks waited --ddp_timeout {waited:g} s after {what}: {where} (stuck: a "
                    "reward function that never returns, a dead node; or slower than that: raise --ddp_timeout); "
                    "nothing saved, a checkpoint needs every rank", announce=rank == min(set(range(world)) - set(late),
                                                                             default=rank)) from None
    note_phase(f"after {what}")


STOPPED_ALONE = "rloo/stopped_alone"  # set by a rank that stops on its own: the others' failed collectives echo it


def stopped_alone(mark: bool = False) -> bool:
    """Whether a rank has marked (with `mark`: marks) in the store that it stops on its own, having said why."""
    store = process_group_store()
    with contextlib.suppress(RuntimeError):  # the store is gone too: nothing to say or learn
        if store is not None and mark:
            store.set(STOPPED_ALONE, "1")
        return store is not None and store.check([STOPPED_ALONE])
    return False


def barrier(what: str = "a barrier") -> None:
    wait_for_peers(what)


def end_distributed() -> None:
    """The process group torn down, once the caller has dropped its DDP wrapper. DDP's reducer holds the group too;
    were it the last holder, its destructor, which keeps the GIL, would join gloo's worker threads while one of them
    waits for the GIL to free a tensor: a hang at the very end of a CPU run (pytorch#56297). Collected first (the gc
    for its reference cycles), the wrapper leaves the group to destroy_process_group, which frees it without the GIL."""
    if dist.is_initialized():
        gc.collect()  # a full collection: ~1 s of a busy CPU, needed only here
        dist.destroy_process_group()


@contextlib.contextmanager
def reward_faults(device: torch.device, what: str, after_training: bool = False):
    """Around the scoring of completions: a RewardFunctionError on any rank is raised on every rank together, with
    the failing rank's message (said once, by rank 0), instead of the others waiting for it in the next collective;
    a rank that has not finished within --ddp_timeout is named (wait_for_peers)."""
    error = None
    try:
        yield
    except RewardFunctionError as e:
        error = e
    if not dist.is_initialized():
        if error is not None:
            error.after_training = after_training
            raise error
        return
    wait_for_peers(what)
    if not all_reduce(torch.tensor([float(error is not None)], device=device), dist.ReduceOp.MAX).item():
        return
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else (str(error), error.signal_name))
    rank, (message, signal_name) = min(((r, m) for r, m in enumerate(messages) if m is not None),
                                       key=lambda failed: failed[1][1] is not None)  # a failure before a signal
    raise RewardFunctionError(f"{message} (rank {rank}, {what})", announce=dist.get_rank() == 0,
                              after_training=after_training, signal_name=signal_name) from None


# ===================================================================== checkpoints: output_dir, save, resume
# ---- output_dir: one run at a time, nothing deleted
class OutputDirLock:
    """An exclusive advisory lock (flock) on output_dir/run.lock, held from acquire() until release() or this
    process exits; the OS releases it then, so a crash never leaves a stale lock. A second run into the same
    output_dir (a job submitted twice, a requeue while the old job still runs) stops at acquire(), naming the
    holder's pid and host. rloo.main makes one at its start and holds it for the whole run: rank 0 acquires it
    (take_output_dir), the stop signals consult it."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.file = None  # the lock file, open while held
        self.created: list[Path] = []  # the directories made for it, the deepest first

    @property
    def held(self) -> bool:
        return self.file is not None

    def acquire(self) -> None:
        if self.held:
            return
        path = Path(self.output_dir)
        created = [d for d in (path, *path.parents) if not d.exists()]
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock = open(path / LOCK, "a+")
        except OSError as e:
            raise ConfigError(f"cannot write to --output_dir {self.output_dir}: {e.strerror or e}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(lock.fileno()).st_ino != os.stat(path / LOCK).st_ino:  # removed by the run that held it
                lock.close()  # between our open and our flock: lock the file now at that path instead
                return self.acquire()
        except FileNotFoundError:  # removed by the run that held it after our flock: the same
            lock.close()
            return self.acquire()
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "a process that has not written its pid yet"
            lock.close()
            raise ConfigError(f"--output_dir {self.output_dir} is in use by another run ({holder}): wait for it to "
                              "end or stop it, or pass another --output_dir") from None
        except OSError as e:  # a filesystem without locks (Lustre without -o flock, some NFS setups)
            print(f"rloo.py: warning: cannot lock --output_dir {self.output_dir} ({e.strerror or e}): a second run "
                  "into it would not be stopped", file=sys.stderr)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        self.file, self.created = lock, created
        atexit.register(self.release)  # whatever ends the run (sys.exit, an exception), but os._exit and SIGKILL

    def release(self) -> None:
        """When the run ends (finished, refused, stopped, failed), by the process that holds it: the lock file
        removed (while still locked: a run that opened it meanwhile sees it gone and locks the new one), and after
        a refused start the directories made for it if they are empty."""
        if not self.held:
            return
        (Path(self.output_dir) / LOCK).unlink(missing_ok=True)
        self.file.close()
        self.file = None
        for directory in self.created:
            try:
                directory.rmdir()
            except OSError:  # not empty
                break


def take_output_dir(lock: OutputDirLock, rank: int, inputs: Optional[dict] = None) -> None:
    """Before anything is read from output_dir, rank 0 makes it this run's: refused if empty or if it is, holds or
    lies inside one of the run's `inputs` (run_inputs), so that not even the lock is written there; locked (`lock`
    acquired), the marker of
    an earlier stop removed (a resume that then fails or is refused is not requeued forever), the temporary
    directories of killed saves removed (they can be as large as a checkpoint)."""
    if not lock.output_dir.strip():
        raise ConfigError(f"--output_dir {lock.output_dir!r} is empty: pass a directory (`.` for this one)")
    check_no_input_inside(lock.output_dir, inputs or {})
    path = Path(lock.output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--output_dir {lock.output_dir} is a file: pass a directory")
    if rank != 0:
        return
    lock.acquire()
    (path / PREEMPTED).unlink(missing_ok=True)
    for debris in (path / CHECKPOINTS).glob(".tmp_step_*"):
        shutil.rmtree(debris, ignore_errors=True)


def rng_state(sampling: torch.Generator) -> dict:
    """Every generator's state, in tensors and plain values only (what torch.load reads with weights_only)."""
    _, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "sampling": sampling.get_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, sampling: torch.Generator) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
                         numpy_state["has_gauss"], numpy_state["gauss"]))
    torch.set_rng_state(state["torch"])
    sampling.set_state(state["sampling"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_safely(path: Path):
    """torch.load with weights_only: tensors and plain Python values only, so that reading a checkpoint from
    elsewhere can never run code. Raises ConfigError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise ConfigError(f"{path} holds {refused.group(1) if refused else 'an object'}, not only tensors and plain "
                          "values: refused, as loading it could run code") from None
    except Exception as e:  # a truncated or foreign file: zip, EOF and OS errors
        raise ConfigError(f"{path} cannot be read ({first_line(e)})") from None


def weights_readable_as_the_rest(path: Path) -> None:
    """The *.safetensors that save_pretrained wrote at `path` (through a temporary file, so 0600) get the mode the
    umask gives its other files (config.json, or peft's adapter config)."""
    written = path / ("config.json" if (path / "config.json").is_file() else ADAPTER_CONFIG)
    mode = written.stat().st_mode & 0o777
    for weights in path.glob("*.safetensors"):
        weights.chmod(mode)


def save_policy(policy, tokenizer, path: Path, rank: int) -> None:
    """The policy in HF format (with --use_peft, its adapter in peft's format) and its tokenizer at `path`, written
    by rank 0. With FSDP a collective: every rank sends its shards to rank 0's CPU first."""
    state = None
    if is_fsdp_unit(policy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        policy.save_pretrained(path, state_dict=state)
        tokenizer.save_pretrained(path)
        weights_readable_as_the_rest(Path(path))
        if state is not None:  # fully_shard renamed the class FSDP<Model>: record the model's own name
            config_path = Path(path) / "config.json"
            config = json.loads(config_path.read_text())
            config["architectures"] = [name.removeprefix("FSDP") for name in config.get("architectures") or []]
            config_path.write_text(json.dumps(config, indent=2) + "\n")


OPTIMIZER_SHARDS = "optimizer"  # a checkpoint's directory of sharded optimizer state (FSDP)


def save_optimizer_state(model, optimizer, directory: Path, trainer_state: dict) -> None:
    """With FSDP every rank writes its own shard of the optimizer state under directory/optimizer (a collective,
    torch.distributed.checkpoint: no rank ever holds the whole); otherwise it goes into trainer_state."""
    if is_fsdp_unit(model):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(directory / OPTIMIZER_SHARDS))
        trainer_state["optimizer"] = OPTIMIZER_SHARDS
    else:
        trainer_state["optimizer"] = optimizer.state_dict()


def load_optimizer_state(model, optimizer, checkpoint: Path, trainer_state: dict) -> None:
    if is_fsdp_unit(model):  # each rank reads its own shard
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer)  # the layout to fill, with the state allocated
        dcp.load(state, checkpoint_id=str(checkpoint / OPTIMIZER_SHARDS))
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state)
    else:
        optimizer.load_state_dict(trainer_state["optimizer"])


try:  # what a failed write raises: OSError from Python, RuntimeError from torch.save, SafetensorError
    from safetensors import SafetensorError
    WRITE_ERRORS: tuple = (OSError, RuntimeError, SafetensorError)
except ImportError:
    WRITE_ERRORS = (OSError, RuntimeError)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def rank0_view(value):
    """Rank 0's value on every rank: one listing of a shared directory, whichever node's cache is behind."""
    if not dist.is_initialized():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def file_digests(root: Path, names: Optional[list[str]] = None) -> dict[str, Optional[dict]]:
    """{path relative to root: {"bytes": size, "sha256": hex digest} (None if missing)} of `names`, or of every
    file under root (as rank 0 sees them). Collective when distributed: each rank hashes a share (checkpoints are
    on a filesystem every rank sees), so that a save or a resume reads each file once, all ranks in parallel."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if names is None:
        names = rank0_view(sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()))
    digests = {name: {"bytes": (root / name).stat().st_size, "sha256": sha256_of(root / name)}
               if (root / name).is_file() else None for name in names[rank::world]}
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, digests)
        digests = {name: value for share in shares for name, value in share.items()}
    return digests


def model_identity(path: str, revision: str = "main") -> dict:
    """What a model is: a local directory's files (top level, hidden ones aside) with their sha256, or a Hub
    model's revision: the commit of the snapshot it loads from (at --model_revision for the policy). Collective when
    distributed (file_digests)."""
    root = Path(path)
    if root.is_dir():
        names = sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
        return {"files": file_digests(root, rank0_view(names))}
    from transformers.utils import cached_file

    config = _from_pretrained(cached_file, path, "policy", filename="config.json", revision=revision)  # .../<commit>/
    return {"revision": Path(config).parent.name}


INPUT_FLAGS = ("model_name_or_path", "sft_model_path", "reward_model_path", "dataset_name", "dataset_test_split",
               "reward_fn")  # the flags that name a run's inputs, fingerprinted at its first start


def run_inputs(args, reward_functions: list[tuple[str, Callable]] = ()) -> dict[str, tuple[str, Optional[Path]]]:
    """Each input of the run, by how a message names it: (what the flag says, its local path, or None for a Hub id,
    which is compared by name). A reward function's input is its source file."""
    inputs = {}
    for flag in INPUT_FLAGS[:4]:
        value = getattr(args, flag)
        if value:
            inputs[flag] = (value, Path(value) if Path(value).exists() else None)
    if args.dataset_test_split and Path(args.dataset_test_split).exists():  # else a split's name
        inputs["dataset_test_split"] = (args.dataset_test_split, Path(args.dataset_test_split))
    for spec, (_, fn) in zip(args.reward_fn, reward_functions):
        source = inspect.getsourcefile(inspect.unwrap(fn)) if callable(fn) else None
        inputs[f"reward_fn {spec}"] = (spec, Path(source) if source else None)
    return inputs


def input_identity(value: str, path: Optional[Path], model: bool, revision: str = "main") -> dict:
    """What an input is, to tell on resume whether it changed: a model as model_identity says; a local file or
    directory by its files' sha256 (every file, at any depth); a Hub dataset or a module without a source file by
    its name. The resolved path is kept to report a move, but not compared."""
    if model:
        identity = model_identity(value, revision)
    elif path is None:
        identity = {"name": value}
    elif path.is_dir():
        identity = {"files": file_digests(path)}
    else:
        identity = {"files": file_digests(path.parent, [path.name])}
    return {**identity, "path": str(path.resolve()) if path is not None else value}


def input_identities(args, reward_functions: list[tuple[str, Callable]] = ()) -> dict[str, dict]:
    """Every input's identity (input_identity), by its name in run_inputs. Collective when distributed."""
    policy = ("model_name_or_path", "sft_model_path")  # where --model_revision applies
    return {name: input_identity(value, path, name.endswith("model_path") or name == "model_name_or_path",
                                 args.model_revision if name in policy else "main")
            for name, (value, path) in run_inputs(args, reward_functions).items()}


def check_same_inputs(saved: dict, current: dict, allowed: tuple[str, ...]) -> list[str]:
    """On resume: every input must be the one the run started with (content, not path), unless its flag is in
    --allow_changed_inputs. Returns the notes to print (allowed changes, moved inputs)."""
    notes = []
    for name in sorted(saved.keys() | current.keys()):
        old, new = saved.get(name), current.get(name)
        content = [{k: v for k, v in (x or {}).items() if k != "path"} for x in (old, new)]
        if content[0] != content[1]:
            if old and new and "files" in old and "files" in new:
                what = "these files differ: " + ", ".join(sorted(
                    n for n in old["files"].keys() | new["files"].keys() if old["files"].get(n) != new["files"].get(n)))
            elif old and new:
                what = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys())
                                 if k != "path" and old.get(k) != new.get(k))
            else:
                what = f"{(old or {}).get('path', 'none')} -> {(new or {}).get('path', 'none')}"
            if name.split(" ")[0] in allowed:
                notes.append(f"{name} changed ({what}), allowed by --allow_changed_inputs")
                continue
            raise ConfigError(f"cannot resume: the input --{name} is not the one the run started with ({what}): "
                              f"restore it, or pass --allow_changed_inputs {name.split(' ')[0]} to continue with it "
                              "as it is now")
        if old and new and old.get("path") != new.get("path"):
            notes.append(f"{name} moved ({old.get('path')} -> {new.get('path')}, same content)")
    return notes


# what the metadata of torch.distributed.checkpoint's optimizer shards is made of: nothing that runs code (the
# private names are what torch's pickle refers to, allowed when read, never called here)
DCP_METADATA_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict")} | {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")})


class MetadataUnpickler(pickle.Unpickler):
    """Reads a pickle, refusing every global but those of DCP_METADATA_GLOBALS and torch's dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or module == "torch" and isinstance(getattr(torch, name, None),
                                                                                      torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def unsafe_metadata(path: Path) -> Optional[str]:
    """Why torch.distributed.checkpoint must not unpickle this .metadata file (it uses plain pickle), or None."""
    try:
        with open(path, "rb") as f:
            MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        return f"{path.name} refers to {e}, which could run code when loaded"
    except Exception as e:  # truncated, or not a pickle at all
        return f"{path.name} cannot be read ({first_line(e)})"
    return None


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why a checkpoint cannot be resumed from, or None when it is intact: its manifest (which every save writes
    last) is missing or unreadable, a file it lists is missing or differs in size or sha256, its
    weights are not in safetensors (a pickle is never loaded), or its optimizer shards' metadata refers to code.
    Collective when distributed."""
    metadata = path / OPTIMIZER_SHARDS / ".metadata"
    try:
        listed = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}, which every save writes: a copy that did not finish, or a damaged checkpoint"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} cannot be read ({type(e).__name__}: {first_line(e)})"
    found = file_digests(path, sorted(listed))
    for name, expected in sorted(listed.items()):
        if found[name] is None:
            return f"{name} is missing"
        if found[name]["bytes"] != expected["bytes"]:
            return f"{name} has {found[name]['bytes']} bytes where the manifest says {expected['bytes']}"
        if found[name]["sha256"] != expected["sha256"]:
            return f"{name} differs from the manifest (sha256)"
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        others = [p.name for p in sorted(path.iterdir()) if p.suffix in (".bin", ".pt", ".pth", ".ckpt")
                  and not p.name.startswith("rng_rank") and p.name != TRAINER_STATE]
        return f"no weights in safetensors ({', '.join(others) or 'none'} instead): a pickle is never loaded"
    return unsafe_metadata(metadata) if metadata.is_file() else None


def steps_to_prune(steps: list[int], keep: Optional[int], newest: int) -> list[int]:
    """The checkpoints --save_total_limit `keep` removes: all but the newest `keep`, never `newest` (the one just
    written); None keeps all."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"save_total_limit = {keep} would remove the checkpoint just written")
    others = sorted(s for s in steps if s != newest)
    return others[: max(0, len(others) - (keep - 1))]


def save_checkpoint(output_dir: str, update: int, model, optimizer, tokenizer, trainer_state: dict, rank: int,
                    save_total_limit: Optional[int], sampling: torch.Generator, rng: Optional[dict] = None) -> Path:
    """Write output_dir/checkpoints/step_<update>: the policy in HF format (loadable on its own) and its
    tokenizer, trainer_state.pt (counters, data position, args; the optimizer, or with FSDP the optimizer/
    directory of shards), every rank's RNG states (`rng`, default: as they are now) and, last, manifest.json
    with the size and sha256 of every file, by which a resume tells an intact checkpoint from a damaged one.
    Everything goes into a temporary directory first, renamed into place once complete, so a process killed
    mid-save leaves the previous checkpoints intact and no half-written step_<n>; a save that fails (a full disk)
    removes its temporary directory and raises a Fault saying so. Multi-node runs need output_dir on a shared
    filesystem: every rank writes its RNG file there."""
    root = Path(output_dir) / CHECKPOINTS
    final, partial = root / f"step_{update}", root / f".tmp_step_{update}"
    what = f"saving checkpoint step_{update}"
    note_phase(what)
    try:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # debris of an earlier save that was killed
            partial.mkdir(parents=True)
        barrier(what)
        torch.save(rng if rng is not None else rng_state(sampling), partial / f"rng_rank{rank}.pt")
        barrier(what)
        save_optimizer_state(model, optimizer, partial, trainer_state)
        save_policy(unwrapped(model), tokenizer, partial, rank)
        if rank == 0:
            torch.save(trainer_state, partial / TRAINER_STATE)
        barrier(what)
        digests = file_digests(partial)
        if rank == 0:
            (partial / MANIFEST).write_text(json.dumps({"files": digests, "run_id": trainer_state.get("run_id"),
                                                        "update": update}, indent=1) + "\n")
    except WRITE_ERRORS as e:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        previous, free = latest_checkpoint(output_dir), shutil.disk_usage(root).free / 2**30
        raise Fault(f"could not write checkpoint step_{update} ({free:.3g} GiB free on its filesystem): "
                    f"{first_line(e)}; the partial one is removed and "
                    + (f"the newest, {previous}, is intact" if previous else "there is no earlier checkpoint")
                    + ": free space (or fix the filesystem) and continue with --resume") from e
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # the same update of this timeline, written again after a fault
        os.replace(partial, final)  # atomic: step_<update> appears complete or not at all
        steps = [int(m.group(1)) for d in root.iterdir() if (m := STEP_DIR.match(d.name))]
        for old in steps_to_prune(steps, save_total_limit, update):
            shutil.rmtree(root / f"step_{old}")
    barrier(what)
    return final


def save_final_policy(policy, tokenizer, output_dir: str, rank: int, checkpoint: Optional[Path] = None) -> list[str]:
    """The finished run's policy and tokenizer in output_dir: hard links to those of `checkpoint`, the final one
    (stored once; a change to either shows in the checkpoint's manifest), copies where the filesystem has no hard
    links, or written (save_policy) when there is no checkpoint. A failed write says how to redo it. Returns the
    names written (on rank 0), which the run record lists as the run's own."""
    written = []
    try:
        if checkpoint is None:
            before = {p.name for p in Path(output_dir).iterdir()}
            save_policy(policy, tokenizer, Path(output_dir), rank)
            written = sorted({p.name for p in Path(output_dir).iterdir()} - before)
        elif rank == 0:
            for file in sorted(checkpoint.iterdir()):
                if not file.is_file() or file.name in (TRAINER_STATE, MANIFEST) or file.name.startswith("rng_rank"):
                    continue
                written.append(file.name)
                (Path(output_dir) / file.name).unlink(missing_ok=True)  # this run's own, of an earlier finish
                try:
                    os.link(file, Path(output_dir) / file.name)
                except OSError:
                    shutil.copy2(file, Path(output_dir) / file.name)
    except WRITE_ERRORS as e:
        raise Fault(f"could not write the final policy to {output_dir}: {first_line(e)}; the final checkpoint "
                    f"{latest_checkpoint(output_dir)} is intact: free space and run the same command with --resume "
                    "to write it") from e
    return written


def checkpoint_dirs(output_dir: str) -> list[Path]:
    """The complete step_<n> directories, newest first; temporary directories are never candidates."""
    root = Path(output_dir) / CHECKPOINTS
    steps = [(int(m.group(1)), d) for d in root.glob("step_*") if (m := STEP_DIR.match(d.name))
             and ((d / MANIFEST).is_file() or (d / TRAINER_STATE).is_file())] if root.is_dir() else []
    return [d for _, d in sorted(steps, reverse=True)]


def latest_checkpoint(output_dir: str) -> Optional[Path]:
    """The complete step_<n> directory with the largest n (not verified: see resume_checkpoint)."""
    return next(iter(checkpoint_dirs(output_dir)), None)


TRAINER_STATE_KEYS = {"update": int, "episode": int, "sampler": dict, "elapsed": float, "world_size": int,
                      "args": dict, "run_id": str, "inputs": dict, "optimizer": (dict, str)}  # and their types


def trainer_state_problem(state) -> Optional[str]:
    """Why a loaded trainer state is not one this version writes (a foreign, forged or older file), or None."""
    if not isinstance(state, dict):
        return f"{TRAINER_STATE} holds a {type(state).__name__}, not a dict"
    if "run_id" not in state and "update" in state:
        return (f"{TRAINER_STATE} has no run_id: written by an older rloo.py, which did not fingerprint its inputs; "
                "continue it with that version, or start a new run")
    for key, kind in TRAINER_STATE_KEYS.items():
        value = state.get(key)
        if key not in state:
            return f"{TRAINER_STATE} has no {key!r}"
        if isinstance(value, bool) or not isinstance(value, kind if kind is not float else (int, float)):
            expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            return f"{TRAINER_STATE}'s {key!r} is of type {type(value).__name__}, not {expected}"
    if not 0 <= state["update"] < 2**62 or not 0 <= state["world_size"] < 2**31 or not 0 <= state["episode"] < 2**62:
        return f"{TRAINER_STATE}'s update, episode or world_size is out of range"
    if not (math.isfinite(state["elapsed"]) and 0 <= state["elapsed"] < 1e10):  # seconds: over 300 years is junk
        return f"{TRAINER_STATE}'s elapsed time {state['elapsed']!r} is not a finite number of seconds"
    if not (isinstance(state["sampler"].get("epoch"), int) and isinstance(state["sampler"].get("position"), int)):
        return f"{TRAINER_STATE}'s sampler state is not {{'epoch': int, 'position': int}}"
    try:  # flags, inputs and ids are plain values: compared with ==, never a tensor or an object
        json.dumps([state["args"], state["inputs"], state["run_id"], state.get("wandb_run_id")], allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        return f"{TRAINER_STATE}'s args or inputs are not plain values ({first_line(e)})"
    return None


def read_checkpoint(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(its trainer state, None), or (None, why it cannot be resumed from, in one line). Collective when
    distributed."""
    problem = checkpoint_problem(path)
    if problem is not None:
        return None, problem
    try:
        state = load_safely(path / TRAINER_STATE)
    except ConfigError as e:
        return None, " ".join(str(e).split())
    except RecursionError:
        return None, f"{TRAINER_STATE} is nested too deeply"
    problem = trainer_state_problem(state)
    return (None, problem) if problem else (state, None)


@dataclass
class Resumption:
    checkpoint: Optional[Path]  # None: start fresh
    state: Optional[dict]  # its trainer state
    skipped: dict  # {damaged checkpoint newer than `checkpoint`: why}


RUN_RECORD = "args.json"  # written last by a finished run: its flags, run_id, and the files it wrote in output_dir


POLICY_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template.*",
                "*.model", "adapter_config.json")  # what a finished run may write at the top of output_dir


def run_record(root: Path) -> Optional[dict]:
    """A finished run's record (args.json holding a run_id), or None: an args.json without one is not this
    project's, as a user's model directory may hold one."""
    try:
        record = json.loads((root / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("run_id"), str) else None


def run_owned(root: Path) -> list[str]:
    """The entries of output_dir that runs of this project wrote, which alone a run may move or write over:
    those of RUN_OUTPUTS, and a finished run's record with the files it lists (its policy and tokenizer) and
    merged/. Everything else is the user's and is never touched."""
    if not root.is_dir():
        return []
    record = run_record(root)
    listed = {RUN_RECORD, MERGED, *[n for n in record.get("files", []) if isinstance(n, str)]} if record else set()
    return sorted(p.name for p in root.iterdir()
                  if p.name in listed or any(fnmatch.fnmatchcase(p.name, n) for n in RUN_OUTPUTS))


def path_forms(path: Path) -> set[Path]:
    """A path as typed (made absolute) and with its symlinks resolved: both are compared."""
    return {Path(os.path.abspath(path)), path.resolve()}


def check_no_input_inside(output_dir: str, inputs: dict[str, tuple[str, Optional[Path]]]) -> None:
    """output_dir neither is, holds nor lies inside an input (any local path of run_inputs), the paths compared
    as typed and with their symlinks resolved."""
    for name, (value, path) in inputs.items():
        if path is None:
            continue
        for out in path_forms(Path(output_dir)):
            for held in path_forms(path):
                if out == held or out in held.parents or held in out.parents:
                    where = "is" if out == held else "holds" if out in held.parents else "is inside"
                    what = name if name.startswith("reward_fn ") else f"{name} {value}"  # the name has the spec
                    raise ConfigError(f"--output_dir {output_dir} {where} the input --{what}: a run "
                                      "must never move or write over its inputs; pass another --output_dir")


def check_output_dir(args, inputs: dict[str, tuple[str, Optional[Path]]], ours: list[Path], set_aside: str) -> None:
    """The output_dir rules, before anything loads: no input inside it or around it (check_no_input_inside);
    another run's files (checkpoints, a finished run's record) are refused unless the run continues them
    (--resume, --resume_from) or --overwrite_output_dir sets them aside; a file the final policy would write over
    that is not a run's is refused. Other files (a log, notes, .git) are the user's: fine."""
    root = Path(args.output_dir)
    check_no_input_inside(args.output_dir, inputs)
    owned = rank0_view(run_owned(root))
    record = rank0_view(run_record(root) is not None)
    if (ours or record) and not (args.resume or args.resume_from or args.overwrite_output_dir):
        what = f"checkpoints up to {ours[0].name}" if ours else "a finished run"
        raise ConfigError(f"--output_dir {root} holds another run's files ({what}): pass --resume to continue it, "
                          f"another --output_dir, or {set_aside}")
    if record and not ours and not args.overwrite_output_dir:  # nothing to continue: its files would be written over
        raise ConfigError(f"--output_dir {root} holds a finished run without checkpoints: nothing to resume; pass "
                          f"another --output_dir, or {set_aside}")
    written = (RUN_RECORD, *POLICY_FILES, *(["README.md"] if args.use_peft else []))  # peft writes a model card
    foreign_policy_files = rank0_view(sorted(
        p.name for p in root.iterdir() if p.name not in owned and p.is_file() and any(
            fnmatch.fnmatchcase(p.name, n) for n in written)) if root.is_dir() else [])
    if foreign_policy_files:
        raise ConfigError(f"--output_dir {root} holds {', '.join(foreign_policy_files[:4])}, which no run of this "
                          "project wrote and the finished run would write over: move them, or pass another "
                          "--output_dir")


def run_ids(root: Path) -> dict[str, str]:
    """{where: run id} of every record in output_dir that names one: each checkpoint's manifest, the finished run's
    record, metrics.jsonl (its last line with one)."""
    ids = {}
    for path in checkpoint_dirs(str(root)):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            ids[f"{CHECKPOINTS}/{path.name}"] = json.loads((path / MANIFEST).read_text()).get("run_id")
    if (record := run_record(root)) is not None:
        ids[RUN_RECORD] = record["run_id"]
    with contextlib.suppress(OSError):
        for line in (root / "metrics.jsonl").read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                ids["metrics.jsonl"] = json.loads(line).get("run_id") or ids.get("metrics.jsonl")
    return {where: i for where, i in ids.items() if isinstance(i, str)}


def check_of_this_run(path: Path, state: dict, root: Path) -> None:
    """A checkpoint continues the run of output_dir only if its stored update is its directory's and every other
    record of output_dir names its run id."""
    if path.name != f"step_{state['update']}":
        raise ConfigError(f"cannot resume from {path}: it holds update {state['update']}, not that of its directory "
                          f"{path.name} (renamed or copied): move it back to step_{state['update']}, or pass another "
                          "checkpoint")
    others = {where: i for where, i in rank0_view(run_ids(root)).items() if i != state["run_id"]
              and where != f"{CHECKPOINTS}/{path.name}"}
    if others and path.resolve().parent == (root / CHECKPOINTS).resolve():
        where, other = next(iter(sorted(others.items())))
        raise ConfigError(f"cannot resume from {path}: it is a checkpoint of run {state['run_id']}, but {root} holds "
                          f"run {other}'s ({where}): move {path.name} out of {root / CHECKPOINTS}, and continue its "
                          "run with --resume_from it and another --output_dir")


def resume_checkpoint(args, inputs: Optional[dict] = None) -> Resumption:
    """Where the run starts: --resume_from, or with --resume the newest intact checkpoint of output_dir (the
    damaged newer ones it skips are named), or nothing. Refused: the output_dir rules (check_output_dir); a
    damaged --resume_from; --resume when no checkpoint is intact; a checkpoint of another run or in a directory
    not its own (check_of_this_run). Collective when distributed."""
    inputs = run_inputs(args) if inputs is None else inputs
    ours = rank0_view(checkpoint_dirs(args.output_dir))
    root = Path(args.output_dir)
    set_aside = f"--overwrite_output_dir to move them to {root / ABANDONED}/ and start over"
    check_output_dir(args, inputs, ours, set_aside)
    earlier = f"an earlier run (checkpoints up to {ours[0].name})" if ours else ""
    if args.resume_from is not None:
        path = Path(args.resume_from)
        if not (path / TRAINER_STATE).is_file():
            raise ConfigError(f"--resume_from {path}: not a checkpoint (no {TRAINER_STATE}); checkpoints are "
                              f"{root / CHECKPOINTS}/step_<n>")
        state, problem = read_checkpoint(path)
        if problem is not None:
            raise ConfigError(f"--resume_from {path} is damaged: {problem}; pass another checkpoint")
        if ours and path.resolve().parent != (root / CHECKPOINTS).resolve() and not args.overwrite_output_dir:
            raise ConfigError(f"--output_dir {args.output_dir} holds {earlier}, not {path}'s: pass another "
                              f"--output_dir, or {set_aside}")
        check_of_this_run(path, state, root)
        return Resumption(path, state, {})
    if args.resume:
        skipped = {}
        for path in ours:
            state, problem = read_checkpoint(path)
            if problem is None:
                check_of_this_run(path, state, root)
                return Resumption(path, state, skipped)
            skipped[path] = problem
        if skipped:
            raise ConfigError(f"--resume: no checkpoint in {root / CHECKPOINTS} is intact ("
                              + "; ".join(f"{p.name}: {why}" for p, why in skipped.items())
                              + f"): pass --resume_from a checkpoint elsewhere, or without --resume, {set_aside}")
    return Resumption(None, None, {})


def move_aside(output_dir: str, names: list[str], why: str) -> Path:
    """Move these entries of output_dir (paths relative to it) into a new output_dir/abandoned/<time>_<why>/,
    where they keep their relative paths. Signals wait until every entry has moved."""
    root = Path(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = root / ABANDONED / f"{stamp}_{why}"
    for n in itertools.count(2):
        if not folder.exists():
            break
        folder = root / ABANDONED / f"{stamp}_{why}_{n}"
    with signals_held():
        for name in names:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(root / name, folder / name)
    return folder


def settle_output_dir(args, start_update: int, skipped: dict, run_id: Optional[str] = None) -> list[str]:
    """Rank 0, before the run writes anything: what output_dir holds beyond the update the run starts from is
    moved to output_dir/abandoned/ (nothing is deleted). With --overwrite_output_dir, every run-owned file
    (run_owned) and nothing else. Otherwise the checkpoints of later updates (another timeline, after
    --resume_from an older one, or damaged ones --resume skipped) and the metrics.jsonl lines after that update or
    of another run id (those of a timeline abandoned, of updates that a killed run logged but did not checkpoint,
    of an earlier run). Then --resume and metrics.jsonl only ever see the timeline being continued. Returns the
    lines to print."""
    root = Path(args.output_dir)
    if args.overwrite_output_dir:
        names = [n for n in run_owned(root) if n not in (LOCK, ABANDONED)]
        if not names:
            return []
        folder = move_aside(args.output_dir, names, "overwritten")
        return [f"--overwrite_output_dir: the earlier run's files ({', '.join(names)}) moved to {folder}"]
    later = [d for d in reversed(checkpoint_dirs(args.output_dir)) if int(d.name.removeprefix("step_")) > start_update]
    metrics = root / "metrics.jsonl"
    kept, dropped = [], []
    for line in metrics.read_text(errors="replace").splitlines(keepends=True) if metrics.is_file() else []:
        try:
            record = json.loads(line)
            (kept if record["update"] <= start_update and record.get("run_id") == run_id else dropped).append(line)
        except (ValueError, KeyError, TypeError, AttributeError):  # a line cut short by a kill
            dropped.append(line)
    if not later and not dropped:
        return []
    folder = move_aside(args.output_dir, [f"{CHECKPOINTS}/{d.name}" for d in later], f"after_update_{start_update}")
    if dropped:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metrics.jsonl").write_text("".join(dropped))
        (root / "metrics.jsonl.tmp").write_text("".join(kept))
        os.replace(root / "metrics.jsonl.tmp", metrics)
    reasons = [f"{d.name}: {skipped[d]}" for d in later if d in skipped]
    (folder / "why.txt").write_text(f"set aside when a run continued from update {start_update}, on "
                                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n" + "".join(f"{r}\n" for r in reasons))
    lines = [f"skipped damaged checkpoint {r}" for r in reasons]
    return lines + [f"continuing from update {start_update}: moved what lies after it ("
                    + ", ".join([d.name for d in later] + ([f"{len(dropped)} metrics.jsonl lines"] if dropped else []))
                    + f") to {folder}"]


def check_resumable(saved: dict, args, world_size: int, saved_world_size: int) -> list[str]:
    """Refuse a resume that would silently be another experiment; return the harmless changes to report. The
    flags that name inputs are compared by what they name (check_same_inputs), not as strings."""
    current = asdict(args)
    # a flag the checkpoint's script does not have (rloo_multinode.py's own, in a rloo.py checkpoint) is no change
    changed = {k: (saved[k], v) for k, v in current.items() if k in saved and saved[k] != v and k not in INPUT_FLAGS}
    refused = sorted(k for k in changed if k not in args.resumable_changes)
    if world_size != saved_world_size:
        refused.append("world size")
        changed["world size"] = (saved_world_size, world_size)
    if refused:
        raise ConfigError("cannot resume: these differ from the checkpoint's run and change its meaning: "
                          + ", ".join(f"{k} ({changed[k][0]!r} -> {changed[k][1]!r})" for k in refused)
                          + "; start a new run in another --output_dir instead")
    return [f"{k} ({old!r} -> {new!r})" for k, (old, new) in sorted(changed.items())
            if k not in ("resume", "resume_from")]


class Checkpointer:
    """The run's checkpoints, behind two calls: load() restores a resumed run's state into the objects it is given
    (and remembers them), save(update, ...) writes them. Created first thing, it takes output_dir (locked: a second
    run into it stops there) and finds the checkpoint to start from, so that a refused resume fails before anything
    loads."""

    def __init__(self, args, dist_info, lock: OutputDirLock, reward_functions: list[tuple[str, Callable]] = ()):
        self.args, self.dist_info, self.lock, self.reward_functions = args, dist_info, lock, reward_functions
        inputs = run_inputs(args, reward_functions)
        take_output_dir(lock, dist_info.rank, inputs)
        with self.refusal_leaves_nothing():
            start = resume_checkpoint(args, inputs)  # verified; --resume falls back past damaged checkpoints
            self.path, self.state, self.skipped = start.checkpoint, start.state, start.skipped
            self.changes = check_resumable(self.state["args"], args, dist_info.world_size,
                                           self.state["world_size"]) if self.state else []
        self.start_update = self.state["update"] if self.state else 0
        self.wandb_run_id = self.state["wandb_run_id"] if self.state else None
        # the run's identity: drawn at its first start, in args.json, every checkpoint and every metrics line
        self.run_id = self.state["run_id"] if self.state else rank0_view(uuid.uuid4().hex)

    def check_continues(self, num_updates: int, episodes_per_update: int) -> None:
        """Refuse a resume past this run's end, or of a run whose inputs changed since its first start."""
        if self.state and self.start_update > num_updates:
            raise ConfigError(f"cannot resume: {self.path} is after update {self.start_update}, but this run ends "
                              f"after update {num_updates}: pass --total_episodes "
                              f"{self.start_update * episodes_per_update} or more, or --resume_from an earlier "
                              "checkpoint")
        self.episodes_per_update = episodes_per_update
        self.inputs = input_identities(self.args, self.reward_functions)
        if self.state:
            self.changes += check_same_inputs(self.state["inputs"], self.inputs, self.args.allow_changed_inputs)

    @contextlib.contextmanager
    def refusal_leaves_nothing(self):
        """For the set-up: a refused run (ConfigError) releases output_dir as it found it."""
        try:
            yield
        except ConfigError:
            self.lock.release()
            raise

    def load(self, model, optimizer, tokenizer, sampler, sampling_rng: torch.Generator, reference=None) -> None:
        """A resumed run's optimizer, data position and sampling generator restored (the weights were loaded with
        the model), and a `reference` model's weights when given (one that changes during the run: TR-DPO's);
        what later saves write."""
        self.model, self.optimizer, self.tokenizer, self.sampler, self.rng = (model, optimizer, tokenizer, sampler,
                                                                              sampling_rng)
        self.reference = reference
        self.start_time = time.time()
        if self.state and reference is not None:
            reference.load_state_dict(self.state["reference"])
        if self.state:
            load_optimizer_state(model, optimizer, self.path, self.state)
            sampler.load_state_dict(self.state["sampler"])
            set_rng_state(load_safely(self.path / f"rng_rank{self.dist_info.rank}.pt"), sampling_rng)
            self.start_time -= self.state["elapsed"]

    def notes(self) -> list[str]:
        """Rank 0, before the run writes anything: output_dir settled for this timeline (settle_output_dir); what
        to print about it."""
        notes = settle_output_dir(self.args, self.start_update, self.skipped, self.run_id)
        if self.state:
            notes.append(f"resuming from {self.path} after update {self.start_update}"
                         + (f"; changed: {', '.join(self.changes)}" if self.changes else ""))
        return notes

    def save(self, update: int, sampler_state: dict, rng: Optional[dict] = None) -> Path:
        """A resumable checkpoint after `update`, the data position `sampler_state` (the sampler before the first
        batch not yet trained on) and the generators' states `rng` (default: as they are now)."""
        trainer_state = {
            "update": update, "episode": update * self.episodes_per_update, "sampler": sampler_state,
            "elapsed": time.time() - self.start_time, "world_size": self.dist_info.world_size,
            "args": asdict(self.args), "wandb_run_id": self.wandb_run_id, "run_id": self.run_id,
            "inputs": self.inputs,
        }
        if self.reference is not None:  # replicated: rank 0's copy is every rank's
            trainer_state["reference"] = {name: t.detach().cpu() for name, t in self.reference.state_dict().items()}
        return save_checkpoint(self.args.output_dir, update, self.model, self.optimizer, self.tokenizer,
                               trainer_state, self.dist_info.rank, self.args.save_total_limit, self.rng, rng)

    def keep(self, finished: int, sampler_state: dict, rng: Optional[dict] = None) -> str:
        """After a fault: the state after update `finished` saved (unless it is already), and how to continue."""
        if finished == self.start_update:  # nothing new: the run can start again as it did
            return "no update had finished since the start, nothing new to save; fix it and run the same command"
        path = Path(self.args.output_dir) / CHECKPOINTS / f"step_{finished}"  # saved already when save_steps divides
        path = path if path.is_dir() else self.save(finished, sampler_state, rng)
        return f"checkpoint of update {finished} saved to {path}; fix it, then continue with --resume"

    def save_final(self, policy, num_updates: int) -> None:
        """The finished run's policy and tokenizer in output_dir, stored once with the final checkpoint's (the one
        this run wrote, or resumed from, as rank 0 sees it)."""
        final = Path(self.args.output_dir) / CHECKPOINTS / f"step_{num_updates}"
        self.final_files = save_final_policy(policy, self.tokenizer, self.args.output_dir, self.dist_info.rank,
                                             final if rank0_view(final.is_dir()) else None)

    def mark_finished(self) -> None:
        """Rank 0, last: the run record args.json (its flags, run_id and the files it wrote at the top of output_dir,
        which run_owned reads), whose presence with the policy marks a finished run."""
        record = {**asdict(self.args), "run_id": self.run_id, "files": getattr(self, "final_files", [])}
        (Path(self.args.output_dir) / RUN_RECORD).write_text(json.dumps(record, indent=2))

    def stopped(self, logger, what: str) -> None:
        """After a stop signal, on rank 0 (the one with a logger): the marker job scripts requeue on, naming the newest
        checkpoint, and a line saying `what` happened and how to continue."""
        if logger is None:
            return
        path = latest_checkpoint(self.args.output_dir)
        where = "no update had finished, nothing to save" if path is None else \
            f"checkpoint of update {path.name.removeprefix('step_')} saved to {path}"
        (Path(self.args.output_dir) / PREEMPTED).write_text(f"{path or where}\n")
        logger.console.print(f"rloo.py: {what}; {where}; continue with the same command and --resume",
                             highlight=False, soft_wrap=True)


# ===================================================================== set-up
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_hub_progress_bars() -> None:
    """Loading bars of datasets and transformers would bury the run's own lines (and one-line errors)."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


# ===================================================================== command line: parsing, exit statuses
# TRL >= 0.22's names for flags of the same meaning, tyro aliases of this project's (README, "Flags": both TRL
# generations' names side by side)
TRL_NAMES = {"num_generations": "rloo_k", "beta": "kl_coef", "epsilon": "cliprange", "num_iterations": "num_ppo_epochs",
             "max_completion_length": "response_length", "normalize_advantages": "normalize_advantage",
             "reward_model_name_or_path": "reward_model_path"}
TRL_DEFAULTS = ("TRL >= 0.22's names are aliases of the flags they are listed beside.\n\nFlags left out keep this "
                "script's defaults:\n--num_iterations 4 (TRL's: 1), --max_completion_length 53 (TRL's: 256).")
STEPS_PER_GENERATION = ("TRL >= 0.22's micro-batches per rank and generation, S (not a rename): taken as "
                        "--num_mini_batches S / gradient_accumulation_steps")

# TRL 1.16's flags (RLOOConfig, the TrainingArguments it inherits, the `trl rloo` script's ModelConfig and
# ScriptArguments) that this project has in another form or not at all. TRL_FIXED: what this project always does,
# accepted when given with that value (case-insensitive), else refused with the reason; TRL_REFUSED: refused
# whatever the value, with the reason. trl_arguments rewrites the rest (see there).
DTYPE_REASON = ("TRL loads and trains the policy's weights in that dtype (pure bf16 with bfloat16); here the policy "
                "keeps fp32 master weights and AdamW state, and --bf16 computes in bf16 (autocast) and stores the "
                "frozen models in bf16: pass --bf16 instead")
TRL_FIXED = {
    "disable_dropout": (("true",), "dropout is always off here, in every model (the policy that trains is the one "
                                   "that sampled)"),
    "shuffle_dataset": (("true",), "the prompts are always reshuffled every epoch, from --seed"),
    "ds3_gather_for_generation": (("true",), "there is no DeepSpeed here; with --fsdp, --fsdp_generation per_block "
                                             "gathers one block at a time"),
    "pad_to_multiple_of": (("auto", "none"), "each forward pass pads to its own longest row, no multiple"),
    "router_aux_loss_coef": (("none", "0", "0.0"), "no mixture-of-experts auxiliary loss is added to the loss"),
    "log_multimodal": (("true", "false"), ""),  # text only: nothing to log either way
    "log_unique_prompts": (("false",), "the sample table shows the first prompts of an update"),
    "use_transformers_continuous_batching": (("false",), "rloo.py samples with its own batched KV-cache loop"),
    "use_transformers_paged": (("false",), "rloo.py samples with its own batched KV-cache loop"),
    "vllm_model_impl": (("vllm",), "engines run vLLM's own model implementation"),
    "do_train": (("true",), "every run trains"),
    "logging_strategy": (("steps",), "metrics are logged every update (--logging_steps: the console line)"),
    "adam_beta1": (("0.9",), "AdamW's betas are torch's (0.9, 0.999)"),
    "adam_beta2": (("0.999",), "AdamW's betas are torch's (0.9, 0.999)"),
    "weight_decay": (("0.01",), "AdamW's weight decay is torch's, 0.01"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "the optimizer is torch's AdamW (fused on CUDA)"),
    "warmup_steps": (("0",), "pass --warmup_ratio (a share of the updates)"),
    "torch_dtype": (("auto", "float32"), DTYPE_REASON),
    "dtype": (("auto", "float32"), DTYPE_REASON),
    "lora_task_type": (("causal_lm",), "the adapters are a causal LM's"),
    "gradient_checkpointing_use_reentrant": (("false",), "gradient checkpointing is non-reentrant here"),
    "remove_unused_columns": (("false",), "every dataset column goes to the reward functions"),
    "ddp_find_unused_parameters": (("false", "none"), "every trained parameter gets a gradient"),
    "dataloader_num_workers": (("0",), "prompts are tokenized once at load time"),
}
TRL_REFUSED = {
    "model_init_kwargs": "rloo.py loads the models itself (fp32 master weights): use --bf16, --trust_remote_code",
    "generation_kwargs": "rloo.py samples with its own loop, not generate(): use its sampling flags (--temperature)",
    "chat_template_kwargs": "the chat template is applied with add_generation_prompt only",
    "cache_implementation": "rloo.py's sampler keeps its own KV cache (--compile_generation: a static one)",
    "vllm_structured_outputs_regex": "guided decoding would change the distribution sampled from, which the "
                                     "trainer's log-probs do not model",
    "vllm_group_port": "the weight sync's port is --engine_port + 1",
    "vllm_max_model_length": "the engines' length is --max_prompt_length + --response_length",
    "fp16": "fp16 needs loss scaling, which rloo.py does not do: use --bf16",
    "tf32": "matmul precision is chosen at start-up (plumbing.choose_kernels)",
    "deepspeed": "there is no DeepSpeed here: --fsdp shards the policy with FSDP2 (under torchrun)",
    "fsdp_config": "--fsdp shards every transformer block with FSDP2; --offload and --fsdp_generation are its options",
    "local_rank": "torchrun sets each process's rank",
    "push_to_hub": "nothing is uploaded: output_dir holds the policy in transformers' format",
    "hub_model_id": "nothing is uploaded: output_dir holds the policy in transformers' format",
    "logging_dir": "metrics go to output_dir/metrics.jsonl (and wandb with --track)",
    "logging_first_step": "every update is logged",
    "do_eval": "evaluation runs when --dataset_test_split is given (--num_evals times)",
    "eval_strategy": "evaluation runs when --dataset_test_split is given, --num_evals times a run",
    "eval_steps": "evaluation runs when --dataset_test_split is given, --num_evals times a run",
    "per_device_eval_batch_size": "evaluation runs --local_rollout_forward_batch_size completions at a time",
    "gradient_checkpointing_kwargs": "gradient checkpointing is non-reentrant here, with no other option",
    "torch_compile": "only decoding is compiled: --compile_generation",
    "use_liger_kernel": "the log-probs come from plumbing.SelectiveLogSoftmax over the completion positions only",
    "dataset_num_proc": "prompts are tokenized in this process",
    "dataset_streaming": "the prompt set is loaded whole (its prompts are shuffled every epoch)",
    "load_in_8bit": "8-bit bases are not supported: --load_in_4bit with --use_peft trains LoRA on a 4-bit base "
                    "(QLoRA)",
    "ignore_bias_buffers": "a DDP option for models with bool buffers; none here needs it",
    "lr_scheduler_kwargs": "the schedules (--lr_scheduler_type, --warmup_ratio) take no options",
    "transformers_continuous_batching_config": "rloo.py samples with its own batched KV-cache loop",
    "save_only_model": "a checkpoint is the whole state a resume needs (policy, optimizer, data position, RNGs)",
    "data_seed": "--seed orders the prompts (and everything else)",
    "full_determinism": "runs are reproducible from --seed on the same hardware (and resume bit-identically)",
    "disable_tqdm": "the progress bar is rich's, on rank 0's console only",
    "label_names": "there are no labels: the rewards come from --reward_model_path and --reward_fn",
    "hub_strategy": "nothing is uploaded: output_dir holds the policy in transformers' format",
    "eval_on_start": "evaluation runs --num_evals times over the run, plus once at the end",
    "include_num_input_tokens_seen": "the tokens of each phase are logged as work/* (metrics.jsonl)",
    "average_tokens_across_devices": "a minibatch's loss is divided by its completions over all ranks "
                                     "(rloo.loss_normalizer)",
}
TRL_REFUSED |= {name: reason for names, reason in (  # the rest of transformers' TrainingArguments, by kind
    (("eval_delay", "prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object",
      "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval",
      "do_predict", "load_best_model_at_end", "metric_for_best_model", "greater_is_better"),
     "evaluation is the mean score of near-greedy completions of --dataset_test_split, --num_evals times a run"),
    (("dataloader_drop_last", "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
      "dataloader_multiprocessing_context", "dataloader_in_order", "train_sampling_strategy", "length_column_name",
      "ignore_data_skip", "auto_find_batch_size"),
     "prompts are drawn by rloo.py's own sampler (reshuffled each epoch from --seed, resumed exactly), no DataLoader"),
    (("log_on_each_node", "logging_nan_inf_filter", "log_level", "log_level_replica", "project", "trackio_space_id",
      "trackio_bucket_id", "trackio_static_space_id", "skip_memory_metrics", "debug"),
     "rank 0 logs to the console, metrics.jsonl and wandb (--track, --wandb_project_name); a NaN stops the run"),
    (("hub_token", "hub_private_repo", "hub_always_push", "hub_revision"),
     "nothing is uploaded: output_dir holds the policy in transformers' format"),
    (("optim_args", "optim_target_modules", "label_smoothing_factor", "neftune_noise_alpha", "use_cache",
      "torch_empty_cache_steps", "torch_compile_backend", "torch_compile_mode", "liger_kernel_config"),
     "the loss and optimizer are rloo.py's own (torch's AdamW: --learning_rate, --adam_epsilon, --max_grad_norm)"),
    (("ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "accelerator_config",
      "parallelism_config", "use_cpu", "save_on_each_node", "enable_jit_checkpoint",
      "restore_callback_states_from_checkpoint"),
     "rloo.py sets up torch.distributed itself under torchrun (NCCL on GPUs, gloo on CPUs: CUDA_VISIBLE_DEVICES= "
     "runs on the CPU) and writes its own checkpoints"),
) for name in names}
ENGINE_FLAGS = ("use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
                "vllm_server_timeout", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization",
                "vllm_tensor_parallel_size", "vllm_model_impl")


def trl_arguments(argv: list[str], fields_of: set[str], prog: str) -> list[str]:
    """argv with TRL's forms rewritten into this project's: `--flag True|False` for a bool flag (--flag /
    --no-flag); `--reward_funcs pkg.module.fn ...` (TRL's dotted paths) as --reward_fn pkg.module:fn; `--report_to
    wandb|none` as --track / --no-track; `--fsdp "full_shard ..."` as --fsdp; `--resume_from_checkpoint DIR` as
    --resume_from DIR (`True`: --resume); for rloo_multinode.py (the script with engines), `--use_vllm` (its engines
    are vLLM's; without --vllm_mode colocated, TRL 1.16's default), `--vllm_server_base_url URL` and
    `--vllm_server_host H --vllm_server_port P` as --engine_urls, `--vllm_server_timeout` as --engine_timeout. A TRL
    flag with no meaning here (TRL_FIXED, TRL_REFUSED, a two-value --reward_clip_range, engine flags given to rloo.py)
    is a ConfigError naming the reason."""
    bools = {name.removeprefix("bool:") for name in fields_of if name.startswith("bool:")}
    fields_of = {name.removeprefix("bool:") for name in fields_of}
    out, i, server = [], 0, {}
    given = {arg[2:].partition("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}

    def values_after(j: int) -> list[str]:  # the values that follow the flag at j (up to the next --flag)
        taken = []
        while j + 1 + len(taken) < len(argv) and not argv[j + 1 + len(taken)].startswith("--"):
            taken.append(argv[j + 1 + len(taken)])
        return taken

    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            i += 1
            continue
        name, has_eq, eq_value = arg[2:].partition("=")
        name = name.replace("-", "_")
        values = [eq_value] if has_eq else values_after(i)
        used = 1 + (0 if has_eq else len(values))
        value = values[0] if values else "true"
        if name in ENGINE_FLAGS and "engine_urls" not in fields_of:
            raise ConfigError(f"--{name}: rloo.py samples in the training processes, without engines; vLLM "
                              "generation is rloo_multinode.py's: `torchrun ... rloo_multinode.py --vllm_mode "
                              "colocate` (or server) with the same flags")
        elif name in TRL_FIXED and name not in fields_of:
            allowed, reason = TRL_FIXED[name]
            if value.lower() not in allowed:
                raise ConfigError(f"--{name} {value}: {reason}; drop the flag")
        elif name in TRL_REFUSED and name not in fields_of:
            raise ConfigError(f"--{name} (TRL's) has no meaning here: {TRL_REFUSED[name]}; drop the flag")
        elif name == "use_vllm":
            if value.lower() not in ("true", "1"):
                raise ConfigError("--use_vllm false: generation in the training processes is rloo.py's (same flags)")
            out.append("--engine=vllm")
            if "vllm_mode" not in given:  # TRL 1.16's default mode (RLOOConfig.vllm_mode), not this script's
                servers = sorted(given & {"vllm_server_base_url", "vllm_server_host", "vllm_server_port"})
                if servers:
                    raise ConfigError(f"--use_vllm without --vllm_mode is colocated vLLM (TRL 1.16's default), "
                                      f"which --{servers[0]} does not serve: add --vllm_mode server")
                out += ["--vllm_mode", "colocate"]
        elif name == "vllm_server_base_url":
            out += ["--engine_urls", value.rstrip("/")]
        elif name in ("vllm_server_host", "vllm_server_port"):
            server[name] = value
        elif name == "vllm_server_timeout":
            out += ["--engine_timeout", value]
        elif name == "reward_funcs":
            for path in values:
                module, dot, function = path.rpartition(".")
                if not dot or ":" in path:
                    raise ConfigError(f"--reward_funcs {path}: TRL's built-in reward functions are not here; pass "
                                      "a dotted import path pkg.module.function (or --reward_fn pkg.module:function)")
                out += ["--reward_fn", f"{module}:{function}"]
        elif name == "report_to":
            targets = {v.lower() for v in values} or {"none"}
            if not targets <= {"wandb", "none"}:
                raise ConfigError(f"--report_to {' '.join(values)}: metrics go to output_dir/metrics.jsonl and, "
                                  "with wandb, to Weights & Biases; pass --report_to wandb or none")
            out.append("--track" if "wandb" in targets else "--no-track")
        elif name == "fsdp" and values and not has_eq and value.lower() not in ("true", "false"):
            if "full_shard" not in value:
                raise ConfigError(f"--fsdp {value!r}: --fsdp shards weights, gradients and optimizer state (FSDP2, "
                                  "as full_shard); pass --fsdp or drop it")
            out.append("--fsdp")
        elif name == "resume_from_checkpoint":
            out += ["--resume"] if value.lower() == "true" else [] if value.lower() in ("false", "none") else \
                ["--resume_from", value]
        elif name == "reward_clip_range" and len(values) > 1:
            raise ConfigError(f"--reward_clip_range {' '.join(values)}: TRL's (min, max) clips raw rewards; here "
                              "--reward_clip_range C clips the --normalize_reward scores to [-C, C]: pass one number "
                              "with --normalize_reward, or clip in the reward function")
        elif name in bools and len(values) == 1 and value.lower() in ("true", "false", "1", "0"):
            out.append(f"--{name}" if value.lower() in ("true", "1") else f"--no-{name}")
        else:
            out += argv[i:i + used]
        i += used
    if server:
        out += ["--engine_urls", f"http://{server.get('vllm_server_host', '0.0.0.0')}:"
                                 f"{server.get('vllm_server_port', '8000')}"]
    return out


def help_groups(cls, program: str) -> dict[str, str]:
    """{first field: title} of the groups --help shows: the `# ----- title -----` lines above fields in the source of
    cls and its bases; a class whose own fields start without one opens a group named after the program."""
    groups = {}
    for c in reversed([c for c in cls.__mro__ if is_dataclass(c)]):
        own = [name for name in inspect.get_annotations(c) if name in c.__dataclass_fields__]
        source = inspect.getsource(inspect.getmodule(c))  # the module's: a class's own would cost a parse of it
        groups |= {own[0]: program} if own else {}
        groups |= {name: title for title, name in re.findall(r"# -+ (.+?) -+\n\s*(\w+):", source) if name in own}
    return groups


def last_values(parts: tuple, default):
    """A list flag's values over its occurrences (--reward_fn a --reward_fn b c: a, b, c); `None` resets it."""
    if not parts:
        return default
    resets = [i for i, part in enumerate(parts) if part is None]
    return None if resets[-1:] == [len(parts) - 1] else sum(parts[(resets or [-1])[-1] + 1:], ())


def parse_error_line(event, flags: list[str]) -> Optional[str]:
    """One line for a parse error tyro is about to report as a box: the flag, what is wrong, the fix (a close match
    among `flags` for an unknown one). None for an event of another kind: tyro's own report then."""
    events = tyro._errors  # tyro's parse-error events (tyro 1.0; constraints.txt pins the version)

    def flag_of(argument) -> str:
        return argument.lowered.name_or_flags[0] if argument is not None and argument.lowered.name_or_flags else "?"

    if isinstance(event, events.UnrecognizedArgs):
        token = event.tokens[0]
        close = difflib.get_close_matches(token.split("=")[0].replace("-", "_").replace("__", "--", 1), flags, n=1)
        return f"unrecognized argument {token!r}: " + (f"did you mean {close[0]}?" if close else "see --help")
    if isinstance(event, events.InstantiationFailure):
        return f"{flag_of(event.argument)}: {' '.join(event.message.split())}; see --help"
    if isinstance(event, events.BadValue):
        return f"{flag_of(event.argument)} " + ("needs a value" if event.offending_value is None else
                                                 f"takes no value, given {event.offending_value!r}") + "; see --help"
    if isinstance(event, events.InvalidChoice):
        return f"{flag_of(event.argument)} {event.value!r} is not one of {', '.join(event.choices)}"
    if isinstance(event, events.MissingArgs):
        return f"missing {', '.join(flag_of(a.arg) for a in event.missing_arguments)}; see --help"
    return None


def raise_parse_error(flags: list[str]) -> Callable:
    """A tyro parse-error hook that raises the one line of parse_error_line as a ConfigError."""
    def hook(event) -> None:
        line = parse_error_line(event, flags)
        if line is not None:
            raise ConfigError(line)
    return hook


def parse_args(cls, argv: Optional[list[str]] = None, prog: Optional[str] = None):
    """The command line parsed by tyro into `cls`, a flat dataclass. tyro parses a dataclass of groups (help_groups)
    built from cls's fields, so --help shows them grouped, under their own names (each field's docstring, joined)
    and TRL >= 0.22's (TRL_NAMES) as aliases. A list flag given several times keeps every value; any other flag,
    under either name, its last, as argparse does (a launch script's "$@" overrides its defaults). TRL's
    --steps_per_generation S is taken as --num_mini_batches S / gradient_accumulation_steps. Bad input is one line
    on stderr and exit status 2, tyro's parse errors included (parse_error_line)."""
    prog = prog or Path(sys.argv[0]).name
    hints = get_type_hints(cls, include_extras=True)
    names = {("bool:" if hints[f.name] is bool else "") + f.name for f in fields(cls)}
    names |= {("bool:" if hints[own] is bool else "") + trl for trl, own in TRL_NAMES.items() if own in hints}
    try:
        argv = trl_arguments(sys.argv[1:] if argv is None else list(argv), names, prog)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    defaults, starts = cls(), help_groups(cls, prog)
    docs = {p.arg_name: " ".join(p.description.split()) for c in reversed(cls.__mro__) if is_dataclass(c)
            for p in docstring_parser.parse_from_object(c).params if p.description}
    # tyro lists a flag's aliases before its name: TRL's name is tyro's and the flag's own its alias, so that --help
    # and tyro's errors show the own name first
    aliases = {own: {"name": trl, "aliases": (f"--{own}",)} for trl, own in TRL_NAMES.items()}
    lists = {name for name, hint in hints.items() if tuple in {get_origin(hint), *map(get_origin, get_args(hint))}}
    groups, title = {}, prog
    for f in sorted(fields(cls), key=lambda f: f.name in inspect.get_annotations(RunArgs)):  # the run's last
        title = starts.get(f.name, title)
        hint = tyro.conf.UseAppendAction[tuple[hints[f.name], ...]] if f.name in lists else hints[f.name]
        conf = tyro.conf.arg(help=docs.get(f.name), **aliases.get(f.name, {}))
        default = () if f.name in lists else getattr(defaults, f.name)
        groups.setdefault(title, []).append((f.name, Annotated[hint, conf], field(default=default)))
        if f.name == "num_mini_batches":
            groups[title].append(("steps_per_generation", Annotated[Optional[int], tyro.conf.arg(
                help=STEPS_PER_GENERATION)], field(default=None)))
    classes = {title: make_dataclass(f"group_{i}", group) for i, (title, group) in enumerate(groups.items())}
    grouped = make_dataclass(cls.__name__, [(f"group_{i}", Annotated[tyro.conf.OmitArgPrefixes[c], tyro.conf.arg(
        name=title)], field(default_factory=c)) for i, (title, c) in enumerate(classes.items())])
    flags = [f"--{name}" for name in (*hints, *(a["name"] for a in aliases.values()), "steps_per_generation")]
    try:
        # one line instead of tyro's box, through tyro 1.0's parse-error hook (tyro._errors, documented there as
        # experimental): a tyro without it shows its box, still exit status 2
        hook = getattr(getattr(tyro, "_errors", None), "on_parse_error", None)
        with hook(raise_parse_error(flags)) if hook else contextlib.nullcontext():
            parsed = tyro.cli(grouped, args=argv, prog=prog, use_underscores=True,
                              description=TRL_DEFAULTS if aliases.keys() & hints.keys() else None,
                              config=(tyro.conf.HelptextFromCommentsOff,))  # the help is given: no source search
        values = {name: value for group in vars(parsed).values() for name, value in vars(group).items()}
        values |= {name: last_values(values[name], getattr(defaults, name)) for name in lists}
        steps = values.pop("steps_per_generation", None)
        if steps is not None:
            accumulation, given = values["gradient_accumulation_steps"], values["num_mini_batches"]
            if steps < 1 or accumulation < 1 or steps % accumulation:
                raise ConfigError(f"--steps_per_generation {steps} (micro-batches per generation) is not a multiple of "
                                  f"gradient_accumulation_steps ({accumulation}); pass --num_mini_batches (optimizer "
                                  "steps per generation) instead")
            values["num_mini_batches"] = steps // accumulation
            if given not in (defaults.num_mini_batches, steps // accumulation):
                raise ConfigError(f"--steps_per_generation {steps} means --num_mini_batches {steps // accumulation} "
                                  f"with gradient_accumulation_steps {accumulation}, but --num_mini_batches {given} "
                                  "is given too: pass one of them")
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    return cls(**values)


def run_script(main: Callable, args, program: str) -> None:
    """main(args), with bad input (ConfigError) turned into one line on stderr and exit status 2, a non-finite
    value before an optimizer step (NonFiniteError) into one line and exit status 3, a fault that stopped the run
    (Fault) into one line and exit status 4, and a signal before training (or a KeyboardInterrupt before its
    handler is set) into one line and exit status 0 (130 for SIGINT; under torchrun 128 + the signal's number).
    Shared by this project's scripts."""
    try:
        try:
            main(args)
            # the run is over: the interpreter's exit need not search the models' and libraries' millions of objects
            # for reference cycles (seconds of a busy CPU after the last line); atexit handlers and finalizers still run
            gc.freeze()
        except BaseException:
            # the run has ended and says how: a stop signal now (torchrun's SIGTERM to the other ranks once one has
            # failed) must not cut that line into a traceback. SIGTERM and SIGUSR1 are ignored, the exit follows;
            # Ctrl-C exits at once. (Not a blocked mask: torch's threads would take the signal for the main thread)
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            raise
    except ConfigError as e:
        print(f"{program}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
        where = Path(args.output_dir) / "nonfinite"
        print(f"{program}: error: {e}: stopped before any optimizer step on it; the offending batch " + (
            f"is in {where}" if e.unwritten is None else f"could not be written to {where} ({e.unwritten})"),
            file=sys.stderr)
        sys.exit(3)
    except Fault as e:
        if e.announce:
            print(f"{program}: error: {e}", file=sys.stderr)
        sys.exit(4)
    except KeyboardInterrupt:  # Ctrl-C before the stop signals' handler is in place (a reward module's import)
        print(f"{program}: SIGINT received while starting: stopped, nothing trained; run the same command again",
              file=sys.stderr)
        sys.exit(130)
    except StartupInterrupted as e:
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            print(f"{program}: {e}", file=sys.stderr)
            sys.exit(130 if e.signal_name == "SIGINT" else 0)
        # under torchrun the rank that got it says so and fails: an exit 0 would leave a rank that did not get it
        # waiting for this one, and torchrun stops the others when one fails, with a SIGTERM of its own that may
        # reach them while they are still starting: those say nothing (a rank has said why already)
        if not stopped_alone():
            print(f"{program}: rank {os.environ['RANK']}: {e}", file=sys.stderr, flush=True)
        stopped_alone(mark=True)
        os._exit(128 + signal.Signals[e.signal_name])  # not sys.exit: no process group teardown that waits
    except RuntimeError as e:  # under torchrun, a collective cut short by a rank that is gone: one line, not a trace
        frames = traceback.extract_tb(e.__traceback__)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "torch/distributed/" not in frames[-1].filename:
            raise
        if not stopped_alone():  # else that rank has said why already
            print(f"{program}: rank {os.environ['RANK']}: error: a collective failed (a rank stopped, was lost or "
                  f"timed out): {first_line(e)}", file=sys.stderr, flush=True)
        os._exit(4)
