"""The run's flags: InputArgs (models, data) and RunArgs (output, checkpoints, memory and speed, LoRA, logging), which
rloo.py's Args extends with the algorithm's, and the checks made before anything loads (validate_args).
"""

import contextlib
import dataclasses
import difflib
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Optional, Union

import torch
import tyro

from .errors import FLOAT32_MAX, ConfigError, inert, read_input

__all__ = [  # what this module gives as plumbing.NAME (rloo.py, rloo_multinode.py, the tools, the tests)
    "InputArgs", "RunArgs", "is_finite_number", "is_interval", "SCALE_LIMIT", "within", "number_rules", "PATH_FLAGS",
    "missing_local_path", "resolve_paths", "check_launch_environment", "validate_args", "quantization_config",
    "policy_options",
]


@dataclass
class InputArgs:
    """A run's inputs: the policy, the reward, the prompts. RunArgs extends it and rloo.py's Args extends RunArgs:
    these are flags like the others, listed first by --help and docs/flags.md. A run's flags never change once made
    (dataclasses.replace makes another): a value that changes across updates is the algorithm's state."""

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__ or name not in self.__dataclass_fields__:  # __init__ sets each field once
            raise AttributeError(f"{type(self).__name__}.{name} cannot change during a run (a checkpoint's resume "
                                 "compares the flags): a value that changes across updates goes in rloo.py's "
                                 "AlgorithmState, which every checkpoint saves and every resume restores")
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        """A path flag as the shell would have given it: a leading `~` (quoted, so the shell left it) is the home
        directory. Here, as the flags are made: they never change afterwards."""
        for flag in PATH_FLAGS:
            value = getattr(self, flag, None)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, flag, os.path.expanduser(value))

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
    """split to train on; a single local file or saved Dataset is one split, `train` (as `datasets` and TRL load it):
    another name is refused"""
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
        "merge_lora", "logging_steps", "save_strategy", "max_steps", "allow_changed_inputs", "eval_strategy",
        "eval_steps", "tensorboard", "trl_defaults"})  # trl_defaults: the values it chose are compared themselves

    # ----- experiment -----
    exp_name: str = "rloo"
    """name of the experiment; the run is named `{exp_name}__{seed}__{unix time}` unless --run_name is given"""
    run_name: Optional[str] = None
    """the run's whole name (wandb, the log's first line), as TRL >= 0.22 takes it;
    None: `{exp_name}__{seed}__{unix time}`"""
    seed: int = 1
    """random seed; rank r samples with seed + r"""
    trl_defaults: Literal["0.21", "1.16"] = "0.21"
    """whose defaults the algorithm's flags left out take: TRL <= 0.21's (the TL;DR recipe's: 4 PPO epochs,
    temperature 0.7, learning rate 3e-6, 53 new tokens, 1 epoch) or TRL 1.16's RLOOConfig's (num_iterations 1,
    temperature 1.0, learning rate 1e-6, max_completion_length 512, 3 epochs; of the run's flags gradient
    checkpointing, seed 42, bf16 on a GPU), and whose arithmetic the run follows: TRL 1.16's counts its length,
    intervals and learning rate in optimizer steps, as its Trainer does"""
    output_dir: str = "models/rloo"
    """where `metrics.jsonl`, `args.json`, the final policy and its tokenizer are written"""
    track: bool = False
    """log to Weights & Biases (with WANDB_MODE=offline it logs without network)"""
    tensorboard: bool = False
    """also write the metrics to TensorBoard event files in output_dir/tensorboard (TRL's --report_to tensorboard;
    torch.utils.tensorboard, which needs `pip install tensorboard`)"""
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
    lora_dropout: float = 0.05
    """dropout on the adapters' input, in training forward passes only (TRL's default); 0: the policy trained is
    exactly the one that sampled"""
    lora_target_modules: Optional[tuple[str, ...]] = None
    """module names to adapt, or `all-linear`; None: peft's default for the architecture (attention projections,
    e.g. q_proj and v_proj for Llama, query_key_value for GPT-NeoX)"""
    lora_target_parameters: Optional[tuple[str, ...]] = None
    """parameter names to adapt directly (peft's target_parameters: e.g. a mixture of experts' stacked weights,
    which are no linear modules), beside --lora_target_modules"""
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
    bnb_4bit_quant_storage: Optional[Literal["uint8", "float16", "bfloat16", "float32"]] = None
    """with --load_in_4bit: the dtype the packed 4-bit weights are stored in; None: bitsandbytes' (uint8)"""

    # ----- samples and evaluation -----
    num_sample_generations: int = 10
    """times per run a table of query / response / score is printed (and logged to wandb)"""
    logging_steps: Union[int, float] = 1
    """the console line every this many updates (metrics.jsonl and wandb get every update's metrics); below 1, that
    share of the run's updates, as TRL's; with --max_steps, optimizer steps, as TRL >= 0.22 counts (update_intervals)"""
    num_evals: int = 4
    """evaluations on --dataset_test_split, spread evenly over the run, the last at its end; plus one of the initial
    policy before the first update (not repeated on resume)"""
    eval_max_prompts: int = 256
    """test prompts per evaluation (all ranks together)"""
    eval_strategy: Optional[Literal["no", "steps", "epoch"]] = None
    """TRL's: no: no evaluation; steps: every --eval_steps; epoch: after each pass over the prompts; with steps or
    epoch, --dataset_test_split defaults to TRL's test. None: --num_evals times, when --dataset_test_split is given"""
    eval_steps: Optional[Union[int, float]] = None
    """with --eval_strategy steps: updates between evaluations (below 1, that share of the run's; with --max_steps,
    optimizer steps, as --logging_steps); None: --logging_steps, as TRL's"""

    # ----- checkpoints and faults -----
    save_steps: Union[int, float] = 0
    """write a resumable checkpoint to output_dir/checkpoints/step_<update> every this many updates (TRL <= 0.21's
    unit; with --max_steps, optimizer steps, TRL >= 0.22's: update_intervals); below 1, that share of the run's,
    as TRL's (0: only at the end, or on a signal)"""
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


SCALE_LIMIT = 1e6  # a coefficient of the rewards or of the loss (--kl_coef, --reward_weights): beyond it the first
# updates' advantages, and the gradients' norm that squares them, overflow float32 (within number_rules' checks)


def within(args, name: str, low: float, high: Optional[float] = SCALE_LIMIT, why: Optional[str] = None) -> tuple:
    """A rule of number_rules' form: the flag `name` in [low, high] (None and NaN are not; high None: any finite
    number >= low), and why where said; a scale (high SCALE_LIMIT) says why."""
    value = getattr(args, name)
    why = why or ("beyond, the first updates' gradients overflow float32" if high == SCALE_LIMIT else None)
    allowed = is_finite_number(value) and low <= value <= (FLOAT32_MAX if high is None else high)
    return name, value, allowed, (f"a finite number >= {low:g}" if high is None else f"in [{low:g}, {high:g}]") + (
        f" ({why})" if why else "")


def is_interval(x) -> bool:
    """An interval flag's value (--logging_steps, --save_steps, --eval_steps): a whole number >= 1, or a share of the
    run in (0, 1), as transformers takes them."""
    return is_finite_number(x) and (0 < x < 1 or (x >= 1 and x == int(x)))


def number_rules(args) -> list[tuple[str, object, bool, str]]:
    """(flag, value, whether it is allowed, what it must be) for every number of the run's flags (RunArgs, InputArgs)
    a typo or a NaN makes meaningless without any error later; the algorithm's are rloo.algorithm_rules."""
    finite = is_finite_number
    a = args
    return [
        ("reward_weights", a.reward_weights, all(abs(w) <= SCALE_LIMIT for w in a.reward_weights or ()),
         f"numbers of at most {SCALE_LIMIT:g} in magnitude (beyond, the first updates' gradients overflow float32)"),
        ("seed", a.seed, 0 <= a.seed < 2**31, "between 0 and 2**31 - 1 (numpy's seeds are unsigned)"),
        ("max_prompt_length", a.max_prompt_length, a.max_prompt_length >= 1, "at least 1"),
        ("local_rollout_forward_batch_size", a.local_rollout_forward_batch_size,
         a.local_rollout_forward_batch_size >= 0, ">= 0 (0: sized to the free memory)"),
        ("num_sample_generations", a.num_sample_generations, a.num_sample_generations >= 0, ">= 0 (0: none)"),
        ("num_evals", a.num_evals, a.num_evals >= 0, ">= 0 (0: only at the end)"),
        ("eval_max_prompts", a.eval_max_prompts, a.eval_max_prompts >= 1, "at least 1"),
        ("logging_steps", a.logging_steps, is_interval(a.logging_steps), "a whole number >= 1, or a share of the run "
         "in (0, 1)"),
        ("save_steps", a.save_steps, a.save_steps == 0 or is_interval(a.save_steps), "a whole number >= 0 (0: only at "
         "the end and on a signal), or a share of the run in (0, 1)"),
        ("eval_steps", a.eval_steps, a.eval_steps is None or is_interval(a.eval_steps), "a whole number >= 1, a share "
         "of the run in (0, 1), or None (then --logging_steps)"),
        ("save_total_limit", a.save_total_limit, a.save_total_limit is None or a.save_total_limit >= 1,
         "at least 1, or None to keep every checkpoint"),
        ("ddp_timeout", a.ddp_timeout, finite(a.ddp_timeout) and a.ddp_timeout > 0, "a finite number of seconds > 0"),
        ("reward_fn_timeout", a.reward_fn_timeout, a.reward_fn_timeout is None or (
            finite(a.reward_fn_timeout) and 0 < a.reward_fn_timeout < a.ddp_timeout),
         f"a number of seconds > 0 and below --ddp_timeout ({a.ddp_timeout:g}; raise it too), or None"),
    ]


PATH_FLAGS = ("model_name_or_path", "sft_model_path", "reward_model_path", "dataset_name", "dataset_test_split",
              "output_dir", "resume_from")  # the flags that may name a local path


def looks_local(value: str) -> bool:
    """Whether a model or dataset flag names a local path rather than a Hub id (`owner/name`): it starts as a path
    does (/, ./, ../, ~), has more parts than owner/name, or its first part is a directory here."""
    parts = Path(value).parts
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..") or len(parts) > 2 or \
        (len(parts) == 2 and Path(parts[0]).is_dir())


def missing_local_path(value: str) -> Optional[str]:
    """For a model or dataset path that looks local (looks_local) and is not there: `no such file or directory`,
    with the existing path closest to it (in the nearest existing directory above it, the entry whose name is most
    like the missing part's: a typo); else None."""
    if Path(value).exists() or not looks_local(value):
        return None
    missing = Path(os.path.abspath(value))
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    try:
        names = [entry.name for entry in missing.parent.iterdir()]
    except OSError:  # not a directory, not readable
        names = []
    close = difflib.get_close_matches(missing.name, names, n=1, cutoff=0.6)
    shown = os.path.relpath(missing.parent / close[0]) if close and not os.path.isabs(value) else \
        str(missing.parent / close[0]) if close else None
    return "no such file or directory" + (f" (the closest that exists: {inert(shown)})" if shown else "")


def resolve_paths(args) -> None:
    """The path flags (`~` expanded as they were made: InputArgs.__post_init__) checked before anything loads: a
    shell variable the shell did not expand (`'$HOME/x'`) is refused, as is a model or dataset path that looks local
    and does not exist (missing_local_path), instead of the Hub's answer to a malformed repo id."""
    for flag in PATH_FLAGS:
        value = getattr(args, flag)
        if not value:
            continue
        variable = re.search(r"\$\{?([A-Za-z_]\w*)", value)
        if variable and not Path(value).exists():
            raise ConfigError(f"--{flag} {value}: ${variable.group(1)} was not expanded (quoted?): the path is "
                              "taken as written; pass it unquoted, or the path itself")
        problem = missing_local_path(value) if flag not in ("output_dir", "resume_from") else None
        if problem and (flag != "dataset_test_split" or "/" in value):  # else a split's name
            raise ConfigError(f"--{flag} {value}: {problem}")


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launch_environment() -> None:
    """A process started with torchrun's RANK, LOCAL_RANK or WORLD_SIZE in its environment must have all of them
    and the rendezvous's address, with values that fit: refused in one line otherwise, before anything loads (left
    exported from an interactive torchrun session, a plain `python rloo.py` would fail deep in torch)."""
    given = [name for name in TORCHRUN_VARIABLES[:3] if name in os.environ]
    if not given:
        return check_processes_asked()
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    fix = (f"launch with torchrun, or unset {' '.join(given)} for a single process (left from a torchrun session?)")
    if missing:
        raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not: {fix}")
    try:
        rank, local_rank, world_size, port = (int(os.environ[name]) for name in (*TORCHRUN_VARIABLES[:3],
                                                                                  "MASTER_PORT"))
    except ValueError:
        shown = ", ".join(f"{name}={inert(os.environ[name], 40)}" for name in TORCHRUN_VARIABLES)
        raise ConfigError(f"torchrun's variables are not all numbers where they must be ({shown}): {fix}") from None
    if not (0 <= rank < world_size and 0 <= local_rank <= rank and 0 < port < 65536):
        raise ConfigError(f"RANK={rank}, LOCAL_RANK={local_rank}, WORLD_SIZE={world_size}, MASTER_PORT={port} do "
                          f"not fit together (0 <= LOCAL_RANK <= RANK < WORLD_SIZE, a port below 65536): {fix}")
    check_processes_asked()


TASK_COUNTS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")  # srun's, mpirun's


def accelerate_processes(seen: int) -> Optional[tuple[str, str]]:
    """Where `accelerate launch` says how many processes it was asked for, and how many (text), when it started this
    process without torchrun (its simple launcher: a MULTI_CPU config, one `python` whatever num_processes says; it sets
    MASTER_ADDR only for several) and asked for another number than `seen`: ACCELERATE_NUM_PROCESSES, else its command
    line's --num_processes or --config_file's num_processes, else the default config file's (read as an input:
    read_input, at most 64 KiB, its aliases never expanded); None when not launched so or asked for `seen`."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ or "WORLD_SIZE" in os.environ \
            or "MASTER_ADDR" not in os.environ or any(name in os.environ for name in TASK_COUNTS):
        return None
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        words = []
    options = {word.partition("=")[0]: word.partition("=")[2] or (words[i + 1] if i + 1 < len(words) else "")
               for i, word in enumerate(words) if word in ("--num_processes", "--config_file")
               or word.startswith(("--num_processes=", "--config_file="))}
    if "--num_processes" in options:
        where, asked = "accelerate launch --num_processes", options["--num_processes"]
    else:
        home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
        path = Path(options.get("--config_file") or os.path.join(home, "accelerate", "default_config.yaml"))
        where, asked = f"accelerate launch's config {path.expanduser()} (num_processes)", None
        if os.path.lexists(path.expanduser()):
            text = read_input(path.expanduser(), f"accelerate launch's config {path.expanduser()}", "write it again "
                              "(accelerate config), or launch with torchrun", 64 << 10).decode(errors="replace")
            asked = yaml_top_level(text, "num_processes")
        where, asked = (where, asked) if asked is not None else ("accelerate launch (it set MASTER_ADDR)", "several")
    with contextlib.suppress(ValueError):
        if int(asked) == seen:
            return None
    return where, inert(asked, 20)


def yaml_top_level(text: str, key: str) -> Optional[str]:
    """The text of a plain scalar `key:` of a YAML mapping, read as nodes (an alias is never expanded); None when the
    text is no such mapping."""
    import yaml  # transformers' dependency

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError, ValueError):
        return None
    pairs = node.value if isinstance(node, yaml.MappingNode) else []
    return next((value.value for name, value in pairs if isinstance(name, yaml.ScalarNode) and name.value == key
                 and isinstance(value, yaml.ScalarNode)), None)


def check_processes_asked() -> None:
    """A launcher that says how many processes it started or was asked for, and a run that sees another number,
    refused in one line naming both: ACCELERATE_NUM_PROCESSES, `accelerate launch` of several processes without
    torchrun (accelerate_processes), srun's SLURM_STEP_NUM_TASKS and mpirun's world sizes. A launcher's tasks are
    torchrun's agents (GROUP_WORLD_SIZE: one torchrun per node) where torchrun runs in them, else the run's processes
    (WORLD_SIZE, 1 without torchrun). SLURM_NTASKS alone is an allocation's, not a launch's (salloc -n 8 then
    torchrun --nproc_per_node 2 is two processes asked for): not compared."""
    seen = int(os.environ.get("WORLD_SIZE", "1"))
    seen_as = f"WORLD_SIZE={seen}" if "WORLD_SIZE" in os.environ else "1 process (no torchrun's WORLD_SIZE)"
    fix = "launch with torchrun: torchrun --nproc_per_node N rloo.py ... (one torchrun per node: --nnodes, " \
          "--rdzv_endpoint); accelerate launch and mpirun start one copy of a script that is not accelerate's"
    asked = os.environ.get("ACCELERATE_NUM_PROCESSES")
    if asked is not None and asked.strip() != str(seen):
        raise ConfigError(f"ACCELERATE_NUM_PROCESSES={inert(asked, 20)} asks for that many processes, but this run "
                          f"has {seen_as}: {fix}")
    accelerate = accelerate_processes(seen)
    if accelerate is not None:
        raise ConfigError(f"{accelerate[0]} asks for {accelerate[1]} processes, but this run has {seen_as}: {fix}")
    agents = os.environ.get("GROUP_WORLD_SIZE") if "TORCHELASTIC_RUN_ID" in os.environ else None
    for name in TASK_COUNTS:
        tasks = os.environ.get(name)
        if tasks is not None and tasks.strip() != (agents or str(seen)):
            has = f"GROUP_WORLD_SIZE={agents} torchrun agents" if agents else seen_as
            raise ConfigError(f"{name}={inert(tasks, 20)} tasks were started, but this run has {has}: each task "
                              f"would train alone; {fix}")


def validate_args(args, launching: bool = True) -> None:
    """Refuse flags that clash before anything is loaded. `launching`: also how this process was started
    (torchrun's variables, --fsdp under torchrun); plan_memory.py, which plans a launch, checks the rest."""
    if launching:
        check_launch_environment()
    resolve_paths(args)
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
    if args.eval_strategy in ("steps", "epoch") and args.dataset_test_split is None:
        raise ConfigError(f"--eval_strategy {args.eval_strategy} evaluates on --dataset_test_split: pass it (TRL's "
                          "default is test)")
    if args.eval_strategy == "no" and args.dataset_test_split is not None:
        raise ConfigError(f"--eval_strategy no, but --dataset_test_split {args.dataset_test_split} asks for "
                          "evaluation: drop one of them")
    if args.eval_steps is not None and args.eval_strategy != "steps":
        raise ConfigError(f"--eval_steps {args.eval_steps} spaces the evaluations of --eval_strategy steps: add it, or "
                          "drop --eval_steps")
    default_evals = next(f.default for f in dataclasses.fields(args) if f.name == "num_evals")
    if args.eval_strategy is not None and args.num_evals != default_evals:
        raise ConfigError(f"--num_evals {args.num_evals} spreads the evaluations over the run without --eval_strategy, "
                          f"and --eval_strategy {args.eval_strategy} " + ("evaluates nowhere" if args.eval_strategy ==
                                                                           "no" else "places them itself")
                          + ": drop one of them")
    if args.pad_token is not None and not args.pad_token:
        raise ConfigError("--pad_token '' is empty: pass a token (the default [PAD], or one the tokenizer has, such as "
                          "its EOS), or None to refuse a tokenizer without one")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--report_to tensorboard (--tensorboard) writes through torch.utils.tensorboard, which needs "
                          "the tensorboard package: pip install tensorboard (or drop it)")
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
        if args.lora_r < 1 or args.lora_alpha <= 0 or not 0 <= args.lora_dropout < 1:
            raise ConfigError(f"--lora_r {args.lora_r}, --lora_alpha {args.lora_alpha}, --lora_dropout "
                              f"{args.lora_dropout}: the rank must be >= 1, alpha > 0 and dropout in [0, 1)")
        if args.lora_target_parameters and args.lora_dropout:
            raise ConfigError(f"--lora_target_parameters: peft's adapters on parameters take no dropout, and "
                              f"--lora_dropout is {args.lora_dropout:g} (TRL's default): pass --lora_dropout 0")
    elif args.merge_lora:
        raise ConfigError("--merge_lora merges LoRA adapters into the base: add --use_peft")
    elif args.load_in_4bit:
        raise ConfigError("--load_in_4bit quantizes a base that LoRA adapters train on (QLoRA), and a 4-bit model "
                          "cannot train itself: add --use_peft")
    elif args.use_rslora or args.use_dora or args.lora_target_parameters:
        option = next(name for name in ("use_rslora", "use_dora", "lora_target_parameters") if getattr(args, name))
        raise ConfigError(f"--{option} is an option of LoRA adapters: add --use_peft")
    if args.load_in_4bit:
        if args.fsdp:
            raise ConfigError("--load_in_4bit with --fsdp: FSDP2 would shard bitsandbytes' 4-bit weights as plain "
                              "bytes, without the quantization state their layers compute with: drop --fsdp (DDP "
                              "replicates the 4-bit base, half a byte per weight)")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("--load_in_4bit quantizes the base with bitsandbytes, which is not installed: pip "
                              "install bitsandbytes (or drop the flag)")
        if args.bf16_generation:
            raise ConfigError("--bf16_generation samples from a bf16 copy of the policy, but a --load_in_4bit base "
                              "is 4-bit: drop --bf16_generation (the 4-bit base samples as it trains)")
    elif args.bnb_4bit_quant_type != "nf4" or args.use_bnb_nested_quant or args.bnb_4bit_quant_storage:
        option = next(name for name, on in (("use_bnb_nested_quant", args.use_bnb_nested_quant),
                                            ("bnb_4bit_quant_storage", args.bnb_4bit_quant_storage),
                                            ("bnb_4bit_quant_type", True)) if on)
        raise ConfigError(f"--{option} is an option of the 4-bit base: add --load_in_4bit (with --use_peft)")
    if launching and args.fsdp and "RANK" not in os.environ:
        raise ConfigError("--fsdp shards the policy over torchrun's processes: launch with torchrun")
    check_model_options(args)


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
                              bnb_4bit_compute_dtype=torch.float32,
                              **({"bnb_4bit_quant_storage": args.bnb_4bit_quant_storage}
                                 if args.bnb_4bit_quant_storage else {}))


def policy_options(args) -> dict:
    """from_pretrained's arguments for the policy's base (TRL's model_init_kwargs): its revision, attention and
    4-bit quantization."""
    options = {"revision": args.model_revision, "attn_implementation": args.attn_implementation}
    return options | ({"quantization_config": quantization_config(args)} if args.load_in_4bit else {})
