"""The command line: tyro parsing with one-line errors, TRL's names (>= 0.22's aliases, 1.16's options taken with their
meaning or refused with the reason, TRL 1.16's defaults accepted as asking for nothing), --config files in TRL's recipe
format, and run_script: a run's end as an exit status and one line.
"""

import atexit
import contextlib
import difflib
import functools
import gc
import inspect
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional, get_args, get_origin, get_type_hints

import docstring_parser
import tyro
import tyro._errors  # parse_args' one-line parse errors
import yaml  # transformers' dependency

from .distributed import stopped_alone
from .errors import ConfigError, Fault, describe, first_line, inert, not_a_file, program, read_input, shown, write_own
from .faults import NonFiniteError, StartupInterrupted, StopSignal, console_survives, run_only
from .flags import PATH_FLAGS, RunArgs
from .rewards import end_processes_left, exit_bounded

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "TRL_NAMES", "TRL116", "TRL_FIXED", "TRL_REFUSED", "parse_args", "run_script", "run_tool", "write_generated",
]

# TRL >= 0.22's names for flags of the same meaning, tyro aliases of this project's (README, "Flags": both TRL
# generations' names side by side)
TRL_NAMES = {"num_generations": "rloo_k", "beta": "kl_coef", "epsilon": "cliprange", "num_iterations": "num_ppo_epochs",
             "max_completion_length": "response_length", "normalize_advantages": "normalize_advantage",
             "reward_model_name_or_path": "reward_model_path", "activation_checkpointing": "gradient_checkpointing"}


# TRL 1.16's `trl rloo` fields with their defaults, read from its dataclasses by benchmark/trl116_defaults.py (a test
# compares the table with the TRL 1.16 of `make bench-env`): a flag given at TRL's default asks for nothing the
# user chose (trl_default_given)
TRL116_TABLE = json.loads(Path(__file__).with_name("trl116_defaults.json").read_text())
TRL116 = {name: default for fields in TRL116_TABLE["fields"].values() for name, default in fields.items()}


# TRL 1.16's GRPOConfig fields that its RLOOConfig lacks (the table's grpo_only): GRPO's options, named as GRPO's,
# with what RLOO does instead where there is something to say. The names rloo.py has (GRPO's vLLM importance sampling
# correction) are its flags.
GRPO_ONLY = frozenset(TRL116_TABLE["grpo_only"])
GRPO_REASONS = {
    "loss_type": "RLOO's loss is the clipped surrogate of each completion's sequence ratio, averaged over the "
                 "completions (per token with --token_level_kl), not one of GRPO's token normalizations",
    "scale_rewards": "RLOO's advantage is the reward minus the mean of the other k-1, unscaled; --normalize_advantage "
                     "whitens them over the batch, --normalize_reward standardizes the scores",
    "importance_sampling_level": "the ratio is the sequence's; --token_level_kl makes it per token",
    "delta": "the ratio is clipped to [1 - --cliprange, 1 + --epsilon_high]",
    "multi_objective_aggregation": "the reward sources are summed with --reward_weights",
}


# Other codebases' and peft's names of the LoRA flags (OpenRLHF's and verl's lora_rank, peft's LoraConfig fields),
# rewritten to this project's; peft's other LoraConfig options are refused (PEFT_REFUSED): the adapters take peft's
# default for them
LORA_NAMES = {"lora_rank": "lora_r", "r": "lora_r", "target_modules": "lora_target_modules",
              "modules_to_save": "lora_modules_to_save", "target_parameters": "lora_target_parameters"}
PEFT_REFUSED = ("exclude_modules", "fan_in_fan_out", "bias", "lora_bias", "init_lora_weights", "layers_to_transform",
                "layers_pattern", "rank_pattern", "alpha_pattern", "layer_replication", "trainable_token_indices",
                "loftq_config", "eva_config", "corda_config", "lora_ga_config", "use_qalora", "qalora_group_size",
                "megatron_config", "use_bdlora", "ensure_weight_tying")
LORA_FLAGS = ("--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules, --lora_target_parameters, "
              "--lora_modules_to_save, --use_rslora, --use_dora")


NOTHING = (None, False, -1, 0, "", "no", "none", [], {})  # how TRL's defaults say "not set" or "off"


TRL_DEFAULTS = ("TRL >= 0.22's names are aliases of the flags they are listed beside.\n\nThe algorithm's flags left "
                "out take TRL <= 0.21's defaults (the TL;DR recipe's):\n--num_iterations 4 (TRL 1.16's: "
                f"{TRL116['num_iterations']}), --max_completion_length 53 (TRL 1.16's: "
                f"{TRL116['max_completion_length']}); --trl_defaults 1.16 gives them TRL 1.16's.")


TRL_NEWER = ("max_steps", "steps_per_generation", "generation_batch_size")  # TRL >= 0.22's way of sizing a run


TRL_RELEASES = {"0.21": "TRL <= 0.21's", "1.16": "TRL 1.16's"}  # --trl_defaults: whose defaults the algorithm's take


def algorithm_defaults(cls) -> dict[str, tuple]:
    """{flag: (TRL <= 0.21's default, TRL 1.16's)} of cls's algorithm flags (those of the class that extends
    plumbing.RunArgs, rloo.py's Args: not the run's, nor rloo_multinode.py's engines') whose TRL 1.16 default (TRL116,
    under TRL >= 0.22's name) is another value, one that sets something (TRL's "not set", NOTHING, is this script's:
    --max_steps -1 is None): what --trl_defaults switches. The class's defaults are TRL <= 0.21's."""
    trl_name, base = {own: trl for trl, own in TRL_NAMES.items()}, cls()
    algorithm = next((c for c in cls.__mro__ if RunArgs in c.__bases__), cls)
    run_flags = {f.name for f in fields(RunArgs)}
    return {f.name: (getattr(base, f.name), TRL116[trl]) for f in fields(algorithm)
            if f.name not in run_flags and (trl := trl_name.get(f.name, f.name)) in TRL116
            and TRL116[trl] not in NOTHING and TRL116[trl] != getattr(base, f.name)}


TRL116_RUN = ("bf16", "gradient_checkpointing", "seed")  # the run's flags whose TRL 1.16 defaults --trl_defaults 1.16
# takes too: they change what the run computes (bf16: where the device has it, TRL's None being bf16 unless fp16)


def bf16_here() -> bool:
    """Whether this process's device computes in bf16 where TRL 1.16's default asks for it: a GPU (rloo.py trains on
    CUDA or the CPU; on the CPU TRL refuses bf16 without --use_cpu, and autocast's bf16 is slow there)."""
    import torch

    return torch.cuda.is_available()


def release_defaults(cls, release: str) -> dict[str, tuple]:
    """{flag: (TRL <= 0.21's default, TRL 1.16's)} of what --trl_defaults switches: the algorithm's flags
    (algorithm_defaults) and, of the run's, TRL116_RUN's; bf16 only where this device has it (bf16_here). Only
    under --trl_defaults 1.16 is the device asked: not otherwise, nor for --help's listing."""
    base, run = cls(), {"gradient_checkpointing": TRL116["gradient_checkpointing"], "seed": TRL116["seed"]}
    if release == "1.16":
        run["bf16"] = bf16_here()
    return algorithm_defaults(cls) | {name: (getattr(base, name), value) for name, value in run.items()
                                      if value != getattr(base, name)}


def release_asked(argv: list[str]) -> str:
    """The last --trl_defaults of argv ("0.21" when none; a value that is neither is left to tyro to refuse)."""
    release = "0.21"
    for i, arg in enumerate(argv):
        name, has_eq, value = arg.partition("=")
        if name.replace("-", "_") == "__trl_defaults":
            value = value if has_eq else argv[i + 1] if i + 1 < len(argv) else ""
            release = value if value in TRL_RELEASES else release
    return release


def defaults_in_force_line(cls, values: dict, given: set[str], release: str, prog: str) -> Optional[str]:
    """One line naming each algorithm flag left out (not in `given`, this script's names) whose value in force, the
    `release`'s default, the other release's default would change (--num_train_epochs is not in force with
    --max_steps or --total_episodes), and the flag that switches; None when there is none."""
    other = "0.21" if release == "1.16" else "1.16"
    trl_name = {own: trl for trl, own in TRL_NAMES.items()}
    changed = [f"--{name}" + (f" (--{trl_name[name]})" if name in trl_name else "")
               + f" {values[name]} ({TRL_RELEASES[other]}: {pair[other == '1.16']})"
               for name, pair in release_defaults(cls, release).items() if name not in given
               and not (name == "num_train_epochs" and (values.get("max_steps") or values.get("total_episodes")))]
    return changed and (f"{prog}: {TRL_RELEASES[release]} defaults in force (--trl_defaults {release}): "
                        f"{', '.join(changed)}; --trl_defaults {other} takes {TRL_RELEASES[other]}") or None


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
    "optim": (("adamw_torch", "adamw_torch_fused"), "the optimizer is torch's AdamW (fused on CUDA)"),
    "torch_dtype": (("auto", "float32"), DTYPE_REASON),
    "dtype": (("auto", "float32"), DTYPE_REASON),
    "lora_task_type": (("causal_lm",), "the adapters are a causal LM's"),
    "gradient_checkpointing_use_reentrant": (("false",), "gradient checkpointing is non-reentrant here"),
    "remove_unused_columns": (("false",), "every dataset column goes to the reward functions"),
    "ddp_find_unused_parameters": (("false", "none"), "every trained parameter gets a gradient"),
    "dataloader_num_workers": (("0",), "prompts are tokenized once at load time"),
    "eval_on_start": (("true",), "the initial policy is always evaluated (update 0) when the run evaluates"),
    "average_tokens_across_devices": (("true",), "a minibatch's loss is divided by its completions over all ranks "
                                                 "(rloo.loss_normalizer)"),
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
    "do_eval": "evaluation runs when --dataset_test_split is given (--num_evals times), or as --eval_strategy says",
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
    "include_num_input_tokens_seen": "the tokens of each phase are logged as work/* (metrics.jsonl)",
    "datasets": "one dataset per run: --dataset_name (with --dataset_config, --dataset_train_split)",
    "streaming": "the prompt set is loaded whole (its prompts are shuffled every epoch)",
    "test_split_size": "the test prompts are a split or file of their own: --dataset_test_split",
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
      "parallelism_config", "save_on_each_node", "enable_jit_checkpoint",
      "restore_callback_states_from_checkpoint"),
     "rloo.py sets up torch.distributed itself under torchrun (NCCL on GPUs, gloo on CPUs: CUDA_VISIBLE_DEVICES= "
     "runs on the CPU) and writes its own checkpoints"),
) for name in names}


# The `trl` command's own options (it launches the script with `accelerate launch`): the launcher here is torchrun
LAUNCH_WITH_TORCHRUN = ("launch rloo.py with torchrun: torchrun --nproc_per_node GPUS rloo.py ... (across nodes, add "
                        "--nnodes N --rdzv_backend c10d --rdzv_endpoint HOST:PORT)")
TRL_LAUNCHER = {name: f"`trl`'s accelerate option; {LAUNCH_WITH_TORCHRUN}" for name in (
    "num_processes", "accelerate_config", "config_file", "num_machines", "machine_rank", "main_process_ip",
    "main_process_port", "mixed_precision", "multi_gpu", "gpu_ids", "rdzv_backend", "use_deepspeed", "use_fsdp",
    "same_network", "dynamo_backend")}


ENGINE_FLAGS = ("use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
                "vllm_server_timeout", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization",
                "vllm_tensor_parallel_size", "vllm_model_impl")


def trl_default_given(name: str, values: list[str]) -> bool:
    """Whether `--name values` (as a command line or a --config file spells them) is TRL 1.16's default of a
    `trl rloo` field (TRL116): a switch alone is True, None / null is None (a `~` is a path: the home directory),
    numbers compare as numbers."""
    if name not in TRL116:
        return False
    default, values = TRL116[name], values or ["true"]
    if isinstance(default, (list, dict)):
        return not default and values == ["true"]  # an empty list or mapping: the flag with no values
    if len(values) != 1:
        return False
    text = values[0].strip().lower()
    if default == "no" and text == "false":  # YAML reads an unquoted no as False
        return True
    if default is None or isinstance(default, bool):
        return text in {None: ("none", "null"), True: ("true", "1"), False: ("false", "0")}[default]
    if isinstance(default, (int, float)):
        try:
            return float(text) == default
        except ValueError:
            return False
    return text == str(default).lower()


def takes_as_own(hint, value: str) -> bool:
    """Whether a flag of type `hint` has `value` among its own choices (a Literal's): TRL's `--eval_strategy no`
    is this script's `no` too, not a default left out."""
    choices = [a for h in (hint, *get_args(hint)) if get_origin(h) is Literal for a in get_args(h)]
    return value in choices


def default_words(name: str, default) -> list[str]:
    """`--name` at `default` as command-line words (None, and a list flag's reset to its default: `None`)."""
    if isinstance(default, bool):
        return [f"--{name}" if default else f"--no-{name}"]
    return [f"--{name}", "None" if default is None or isinstance(default, tuple) else str(default)]


def trl_arguments(argv: list[str], hints: dict, defaults: dict, prog: str) -> list[str]:
    """argv with TRL's forms rewritten into this project's (`hints`: this script's flags and TRL >= 0.22's aliases,
    with their types; `defaults`: its flags' defaults). A `trl rloo` flag given at TRL 1.16's default
    (trl_default_given) asks for nothing: a flag this script does not have is left out; one it has takes TRL's
    default with TRL's meaning, or where TRL's default says "not set" (NOTHING: --max_steps -1, --weight_decay 0.0,
    --save_total_limit None, ...) this script's default, unless that is one of the flag's own choices (--eval_strategy
    no): so a later occurrence still overrides an earlier one. Then `--flag True|False` for a bool flag (--flag /
    --no-flag); `--bf16 None` (TRL's: bf16 unless fp16) as --bf16; `--reward_funcs pkg.module.fn ...` (TRL's
    dotted paths) as --reward_fn pkg.module:fn; `--report_to wandb|tensorboard|none` as --track / --tensorboard /
    neither; `--fsdp "full_shard ..."` as --fsdp; `--resume_from_checkpoint DIR` as --resume_from DIR (`True`:
    --resume); for rloo_multinode.py (the script with engines), `--use_vllm` (its engines are vLLM's; without
    --vllm_mode colocated, TRL 1.16's default), `--vllm_server_base_url URL` and `--vllm_server_host H
    --vllm_server_port P` as --engine_urls, `--vllm_server_timeout` as --engine_timeout. A TRL flag with no meaning
    here (TRL_FIXED, TRL_REFUSED, the `trl` launcher's TRL_LAUNCHER, a two-value --reward_clip_range, engine flags
    given to rloo.py) is a ConfigError naming the reason."""
    bools = {name for name, hint in hints.items() if hint is bool or set(get_args(hint)) == {bool, type(None)}}
    out, i, server = [], 0, {}
    given = {arg[2:].partition("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    engines = "engine_urls" in hints
    converted = {"report_to", "reward_funcs", "resume_from_checkpoint", *(ENGINE_FLAGS if engines else ())}  # TRL's
    # forms of this script's flags, rewritten below

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
        own = TRL_NAMES.get(name, name)  # the flag's name here
        default_given = trl_default_given(name, values) and name != "dataset_name"  # TRL's None: none given
        if name == "num_processes" and values and value.strip() == os.environ.get("WORLD_SIZE", "1"):
            pass  # asks for the processes the run has (TRL's default is 1 without a launcher's config)
        elif name in TRL_LAUNCHER:
            count = f" {value}" if name == "num_processes" and values else " GPUS"
            raise ConfigError(f"--{name}: {TRL_LAUNCHER[name]}".replace(" GPUS", count, 1))
        elif name == "bf16" and value.lower() in ("none", "null"):
            out.append("--bf16")  # TRL's None: bf16 wherever fp16 is not asked for, which is refused here
        elif name == "use_cpu":
            pass  # TRL's: taken by use_cpu() before the defaults were chosen
        elif default_given and own not in hints and name not in converted:
            pass  # a flag this script does not have, at TRL's default: asks for nothing
        elif default_given and own in defaults and TRL116[name] in NOTHING and not takes_as_own(hints[own], value):
            out += default_words(own, defaults[own])  # TRL's "not set": this script's default
        elif name in GRPO_ONLY and name not in hints:
            raise ConfigError(f"--{name} is TRL's GRPOTrainer's (GRPOConfig), not RLOO's: "
                              + GRPO_REASONS.get(name, "RLOOConfig has no such option") + "; drop the flag")
        elif name in LORA_NAMES and name not in hints:
            out += [f"--{LORA_NAMES[name]}", *values]
        elif name in PEFT_REFUSED and name not in hints:
            raise ConfigError(f"--{name} is an option of peft's LoraConfig that the adapters here do not take (they "
                              f"keep peft's default): the LoRA flags are {LORA_FLAGS}; drop it")
        elif name in ENGINE_FLAGS and not engines:
            raise ConfigError(f"--{name}: rloo.py samples in the training processes, without engines; vLLM "
                              "generation is rloo_multinode.py's: `torchrun ... rloo_multinode.py --vllm_mode "
                              "colocate` (or server) with the same flags")
        elif name in TRL_FIXED and name not in hints:
            allowed, reason = TRL_FIXED[name]
            if value.lower() not in allowed:
                raise ConfigError(f"--{name} {value}: {reason}; drop the flag")
        elif name in TRL_REFUSED and name not in hints:
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
        elif name == "reward_funcs" and default_given:
            pass  # TRL's None: no function named
        elif name == "reward_funcs":
            for path in values:
                module, dot, function = path.rpartition(".")
                if not dot or ":" in path:
                    raise ConfigError(f"--reward_funcs {path}: TRL's built-in reward functions are not here; pass "
                                      "a dotted import path pkg.module.function (or --reward_fn pkg.module:function)")
                out += ["--reward_fn", f"{module}:{function}"]
        elif name == "report_to":
            targets = {v.lower() for v in values} or {"none"}
            if not targets <= {"wandb", "tensorboard", "none"}:
                raise ConfigError(f"--report_to {' '.join(values)}: metrics go to output_dir/metrics.jsonl and, "
                                  "with wandb, to Weights & Biases, with tensorboard, to TensorBoard event files; "
                                  "pass --report_to wandb, tensorboard (or both) or none")
            out += ["--track" if "wandb" in targets else "--no-track",
                    "--tensorboard" if "tensorboard" in targets else "--no-tensorboard"]
        elif name == "fsdp" and values and not has_eq and value.lower() not in ("true", "false"):
            if "full_shard" not in value:
                raise ConfigError(f"--fsdp {value!r}: --fsdp shards weights, gradients and optimizer state (FSDP2, "
                                  "as full_shard); pass --fsdp or drop it")
            out.append("--fsdp")
        elif name == "resume_from_checkpoint":
            out += ["--resume"] if value.lower() == "true" else ["--no-resume", "--resume_from", "None"] if \
                value.lower() in ("false", "none") else ["--resume_from", value]
        elif name == "reward_clip_range" and len(values) > 1:
            raise ConfigError(f"--reward_clip_range {' '.join(values)}: TRL's (min, max) clips raw rewards; here "
                              "--reward_clip_range C clips the --normalize_reward scores to [-C, C]: pass one number "
                              "with --normalize_reward, or clip in the reward function")
        elif name in bools | {n for n, own_name in TRL_NAMES.items() if own_name in bools} and len(values) == 1 \
                and value.lower() in ("true", "false", "1", "0"):
            out.append(f"--{name}" if value.lower() in ("true", "1") else f"--no-{name}")
        else:
            out += argv[i:i + used]
        i += used
    if server:
        out += ["--engine_urls", f"http://{server.get('vllm_server_host', '0.0.0.0')}:"
                                 f"{server.get('vllm_server_port', '8000')}"]
    return out


# TRL's names of flags that are this script's under another name or form: a --config key that the command line gives
# under any of its names is left out (the command line wins)
SAME_FLAG = TRL_NAMES | {"reward_funcs": "reward_fn", "report_to": "track", "resume_from_checkpoint": "resume_from",
                         "steps_per_generation": "num_mini_batches", "vllm_server_base_url": "engine_urls",
                         "vllm_server_host": "engine_urls", "vllm_server_port": "engine_urls",
                         "vllm_server_timeout": "engine_timeout", "use_vllm": "engine"} | LORA_NAMES


# what a recipe's key sets, where that is not one flag under one of its names (canonical): TRL's vLLM server given by
# its host and port, two keys, or as one URL; --report_to both --track and --tensorboard
FLAG_PARTS = {"vllm_server_host": ("engine_urls host",), "vllm_server_port": ("engine_urls port",),
              "vllm_server_base_url": ("engine_urls host", "engine_urls port"),
              "engine_urls": ("engine_urls host", "engine_urls port"), "report_to": ("track", "tensorboard")}


CONFIG_LIMITS = {"bytes": 1 << 20, "values": 10_000, "depth": 32, "digits": 100}  # of a --config file: a recipe
# is a few kB of flags; aliases count each time they are used (an alias bomb), digits of a number (5000-digit ints)
YAML_NULL = ("~", "null", "Null", "NULL", "")  # YAML 1.2's core schema's null, written plainly (unquoted)
YAML_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")  # YAML 1.2's core schema's int and float
YAML_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")


def core_number(text: str):
    """The int or float a plain YAML scalar is in YAML 1.2's core schema (`010` is 10, `0x1f` 31, `.inf`, `1e309`
    inf), or None: YAML 1.1's `1:20` (80), `1_000`, `on` are text."""
    if YAML_INT.fullmatch(text):
        base = {"0o": 8, "0x": 16}.get(text[:2], 10)
        return int(text[2:] if base != 10 else text, base)
    if YAML_FLOAT.fullmatch(text):
        return float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))
    return None


class PlainLoader(yaml.SafeLoader):
    """PyYAML's safe loader resolving no plain scalar's type (YAML 1.1's `on`, `010`, `1:20`, dates): read_config
    reads the text."""
    yaml_implicit_resolvers = {}


def read_config(path: str):
    """A --config file as data: {key: value}, each value the text of a scalar as written (a str flag keeps `010`,
    `on`, `1:20` as they read; the flag's own type reads the text later), None for a plain null (`null`, empty; a
    plain `~` is refused for a path flag: quoted, `'~'` is the home directory), a list, or a mapping (its scalars in
    YAML 1.2's core schema). Only a regular file of at most CONFIG_LIMITS bytes in UTF-8 (UTF-16/32 with a BOM);
    aliases and merge keys expand within CONFIG_LIMITS' values and depth; explicit tags other than YAML's own,
    duplicate keys and numbers of more than CONFIG_LIMITS' digits are refused. Every problem is a ConfigError, one
    line naming the file."""
    where = f"--config {path or repr(path)}"
    data = read_input(path, where, "pass a YAML file of flag names and values", CONFIG_LIMITS["bytes"])
    boms = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xef\xbb\xbf", "utf-8-sig"),
            (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))
    encoding = next((name for bom, name in boms if data.startswith(bom)), "utf-8")
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r}): re-encode it as "
                          "UTF-8") from None
    try:
        loader = PlainLoader(text)
        try:
            node = loader.get_single_node()  # nodes, not values: nothing is resolved or expanded yet
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{where} is not valid YAML" + (f" (line {mark.line + 1})" if mark else "")
                          + f": {getattr(e, 'problem', None) or first_line(e)}") from None
    except RecursionError:
        raise ConfigError(f"{where} nests deeper than {CONFIG_LIMITS['depth']} levels: a recipe is a mapping of "
                          "flag names to values") from None
    count = [0]

    def value(node, key: str, depth: int, typed: bool):
        count[0] += 1
        if count[0] > CONFIG_LIMITS["values"] or depth > CONFIG_LIMITS["depth"]:
            what = f"more than {CONFIG_LIMITS['values']:,} values" if depth <= CONFIG_LIMITS["depth"] else \
                f"nesting deeper than {CONFIG_LIMITS['depth']} levels"
            raise ConfigError(f"{where}: {key}: {what}, aliases expanded: a recipe is a mapping of flag names to "
                              "values")
        tag = node.tag.rpartition(":")[2] if node.tag.startswith("tag:yaml.org,2002:") else node.tag
        if tag not in ("str", "int", "float", "bool", "null", "seq", "map", "merge"):
            raise ConfigError(f"{where}: {key}: the tag {node.tag} is not read here: write the value plainly")
        if isinstance(node, yaml.ScalarNode):
            text, plain = node.value, node.style is None
            if plain and depth == 1 and text == "~" and key in PATH_FLAGS:
                raise ConfigError(f"{where}: {key}: ~ unquoted is YAML's null: quote it ('~') for the home "
                                  f"directory (as the command line's), or write null for the default")
            if (plain and text in YAML_NULL) or tag == "null":
                return None
            if len(text) > CONFIG_LIMITS["digits"] and re.fullmatch(r"[-+0-9a-fA-FoxX._:]+", text):
                raise ConfigError(f"{where}: {key}: a number of {len(text):,} digits: no flag takes one that large")
            if typed and plain:  # inside a mapping value (JSON): YAML 1.2's core schema
                if text in ("true", "True", "TRUE", "false", "False", "FALSE"):
                    return text.lower() == "true"
                return text if core_number(text) is None else core_number(text)
            return text
        if isinstance(node, yaml.SequenceNode):
            return [value(item, key, depth + 1, typed) for item in node.value]
        own, merged = {}, {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(f"{where}: {key}: a key that is a {key_node.id}, not a name")
            if key_node.value == "<<" and key_node.style is None:  # a merge key: its mappings' keys, own keys win
                parts = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for part in parts:
                    if not isinstance(part, yaml.MappingNode):
                        raise ConfigError(f"{where}: {key}: a merge key (<<) takes mappings")
                    merged = value(part, key, depth, typed) | merged
                continue
            name = key_node.value
            if name in own:
                raise ConfigError(f"{where}: {key}: the key {name!r} is given twice: keep one")
            own[name] = value(value_node, name if depth == 0 else key, depth + 1, typed or depth > 0)
        return merged | own

    return None if node is None else value(node, "the file", 0, False)


def takes_text(hint) -> bool:
    """Whether a flag of type `hint` (or a list flag of such items) takes text: its value is the YAML scalar as
    written, never a number read from it."""
    return hint is str or any(takes_text(h) for h in get_args(hint) if h is not Ellipsis) or (
        get_origin(hint) is Literal and any(isinstance(a, str) for a in get_args(hint)))


def yaml_values(value, hint, key: str, path: str) -> list[str]:
    """A --config value (read_config's) as command-line words: a list as several values, a mapping as JSON, None as
    None; a number in YAML 1.2's core schema, for a flag that takes no text, as Python writes it (`0x10` is 16,
    `.inf` inf); `false` / `true` as `no` / `yes` for a flag whose choices hold them (--save_strategy no). A word
    that would read as a flag (`--overwrite_output_dir` in a list) is refused: values are never flags."""
    if isinstance(value, list):
        if any(isinstance(item, (list, dict)) for item in value):
            if hint is None:  # no flag of this script (`datasets:`, a launcher's key): its own refusal names it
                return [json.dumps(value)]
            raise ConfigError(f"--config {path}: {key}: a list of lists or mappings: a list flag takes plain values")
        return [word for item in value for word in yaml_values(item, hint, key, path)]
    if isinstance(value, str) and value.lower() in ("false", "true") and takes_as_own(hint, "no"):
        return ["yes" if value.lower() == "true" else "no"]
    number = core_number(value) if isinstance(value, str) and not takes_text(hint) else None
    word = json.dumps(value) if isinstance(value, dict) else str(value if number is None else number)
    if word.startswith("-") and core_number(word) is None:
        raise ConfigError(f"--config {path}: {key}: the value {word[:60]!r} would be read as a flag: a value "
                          "cannot start with - (a flag is a key of its own)")
    return [word]


def config_arguments(argv: list[str], hints: dict, known: set[str]) -> list[str]:
    """argv with `--config FILE.yaml` replaced by the flags the file sets, in TRL's recipe format (a mapping of flag
    names to values, TRL 1.16's names and this script's alike), put before the command line's: a flag the command
    line gives too, under any of its names (SAME_FLAG), is left out of the file's, so the command line wins, list
    flags included. One line naming the file for a file that cannot be read or parsed, a key neither this script
    nor a `trl rloo` recipe knows (with the closest name), and an `env:` section."""
    at = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ConfigError("--config is given twice: pass one file (the command line's flags override it)")
    i = at[0]
    if argv[i] == "--config" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
        raise ConfigError("--config needs a file: --config recipe.yaml")
    path, rest = (argv[i + 1], argv[:i] + argv[i + 2:]) if argv[i] == "--config" else \
        (argv[i].partition("=")[2], argv[:i] + argv[i + 1:])
    config = read_config(path)
    if not isinstance(config, dict):
        holds = "is empty" if config is None else f"holds a YAML {type(config).__name__}"
        raise ConfigError(f"--config {path} {holds}, not a mapping of flag names to values (as TRL's recipes: "
                          "`learning_rate: 1.0e-6`, one per line)")
    if "env" in config:
        raise ConfigError(f"--config {path}: its `env:` section sets environment variables, which rloo.py reads "
                          "as it starts (torch at import, torchrun for every rank): set them in the shell "
                          "(VAR=value python rloo.py ...) and drop the section")

    def plain(name: str) -> str:  # dashes as underscores, a switch's --no- form as the switch
        name = name.replace("-", "_")
        return name[3:] if name.startswith("no_") and name[3:] in known else name

    def canonical(name: str) -> str:
        return SAME_FLAG.get(plain(name), plain(name))

    given = {canonical(arg[2:].partition("=")[0]) for arg in rest if arg.startswith("--")}
    out, named = [], {}  # named: {what a key sets: the key}
    for key, value in config.items():
        name = str(key).replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise ConfigError(f"--config {path}: unknown key {key!r}: " + (
                "a --config file cannot name another" if name == "config" else f"did you mean {close[0]}?" if close
                else "not a flag of this script, nor of TRL's `trl rloo`"))
        words = yaml_values(value, hints.get(name), str(key), path)
        unset = value is None or (trl_default_given(name, words) and TRL116[name] in NOTHING)  # names no value
        for part in () if unset else FLAG_PARTS.get(plain(name), (canonical(name),)):
            if part in named:  # one flag under two names (an alias, a TRL name, dashes, --no-): which would win?
                raise ConfigError(f"--config {path}: the keys {named[part]!r} and {key!r} both set "
                                  f"--{part.split()[0]}: keep one")
            named[part] = key
        if canonical(name) not in given:
            out += [f"--{name}", *words]
    return out + rest


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
    """A list flag's values over its occurrences (--reward_fn a --reward_fn b c: a, b, c); `None` resets it to its
    default."""
    if not parts:
        return default
    resets = [i for i, part in enumerate(parts) if part is None]
    return default if resets[-1:] == [len(parts) - 1] else sum(parts[(resets or [-1])[-1] + 1:], ())


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
    if isinstance(event, events.InvalidChoice):  # an Optional[Literal]'s come from a set (any order): sorted, None last
        choices = sorted(event.choices, key=lambda c: (c == "None", c)) if "None" in event.choices else event.choices
        return f"{flag_of(event.argument)} {event.value!r} is not one of {', '.join(choices)}"
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


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Each field's docstring, from the source of cls and of its dataclass bases: read once per class (parsing the
    source was a third of a parse of the command line)."""
    return {p.arg_name: " ".join(p.description.split()) for c in reversed(cls.__mro__) if is_dataclass(c)
            for p in docstring_parser.parse_from_object(c).params if p.description}


def parse_args(cls, argv: Optional[list[str]] = None, prog: Optional[str] = None):
    """The command line parsed by tyro into `cls`, a flat dataclass. tyro parses a dataclass of groups (help_groups)
    built from cls's fields, so --help shows them grouped, under their own names (each field's docstring, joined)
    and TRL >= 0.22's (TRL_NAMES) as aliases. A list flag given several times keeps every value; any other flag,
    under either name, its last, as argparse does (a launch script's "$@" overrides its defaults); `--config
    FILE.yaml` gives flags that the command line's override (config_arguments), and TRL's forms are rewritten
    (trl_arguments). TRL's --steps_per_generation S is taken as --num_mini_batches S / gradient_accumulation_steps;
    TRL's --eval_strategy no loads no test split, steps or epoch evaluate on TRL's default split (test) when
    --dataset_test_split is not given. Bad input is one line on stderr and exit status 2, tyro's parse errors
    included (parse_error_line)."""
    prog = prog or program()
    console_survives()  # from the first line it may write
    hints = get_type_hints(cls, include_extras=True)
    plain = get_type_hints(cls) | {"steps_per_generation": Optional[int]}  # the types without tyro's markers
    known = {*plain, *TRL_NAMES, *TRL116, *TRL_FIXED, *TRL_REFUSED, *TRL_LAUNCHER, *ENGINE_FLAGS, *GRPO_ONLY,
             *LORA_NAMES, *PEFT_REFUSED}
    argv = sys.argv[1:] if argv is None else list(argv)
    at = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    from_file = at and (argv[at[0]].partition("=")[2] or (argv[at[0] + 1] if at[0] + 1 < len(argv) else ""))
    on_command_line = {arg[2:].partition("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    try:
        argv = config_arguments(argv, plain, known)
        release = release_asked(argv)  # whose defaults the algorithm's flags left out take
        use_cpu(argv)  # before bf16_here asks for the device
        defaults = cls(**{name: pair[1] for name, pair in release_defaults(cls, release).items()}
                       if release == "1.16" else {})
        names = {arg[2:].partition("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
        trl_forms = any(name in TRL_NAMES or name in TRL_NEWER or (name in known and name not in plain)
                        for name in names)  # TRL >= 0.22's names, or TRL's forms of this script's flags
        argv = trl_arguments(argv, plain, {f.name: getattr(defaults, f.name) for f in fields(cls)}, prog)
    except ConfigError as e:
        flag = re.match(r"--(\w+)", str(e))  # a flag the --config file gave (the launcher's, `datasets:`): named so
        where = f"--config {from_file}: " if from_file and flag and flag[1] not in on_command_line else ""
        say(f"{prog}: error: {where}{shown(e)}", argv)
        sys.exit(2)
    starts = help_groups(cls, prog)
    docs = field_docs(cls)
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
        if values.get("eval_strategy") == "no":  # TRL's: no evaluation, nor a test split loaded
            values["dataset_test_split"] = None
        elif values.get("eval_strategy") and values["dataset_test_split"] is None:
            values["dataset_test_split"] = TRL116["dataset_test_split"]  # where TRL's `trl rloo` evaluates
    except ConfigError as e:
        say(f"{prog}: error: {shown(e)}", argv)
        sys.exit(2)
    given = {TRL_NAMES.get(name, name) for name in (arg[2:].partition("=")[0].replace("-", "_").removeprefix("no_")
                                                    for arg in argv if arg.startswith("--"))}
    line = defaults_in_force_line(cls, values, given, release, prog) if from_file or trl_forms else None
    if line and os.environ.get("RANK", "0") == "0":  # a TRL 1.x user is told which of TRL's defaults are not in force
        print(line, flush=True)
    if release == "1.16" and "bf16" not in given and not values["bf16"] and os.environ.get("RANK", "0") == "0":
        print(f"{prog}: TRL 1.16's default bf16 is off here: no GPU (on the CPU, --bf16 computes in bf16 anyway, "
              "slowly)", flush=True)
    return cls(**values)


def use_cpu(argv: list[str]) -> None:
    """TRL's --use_cpu [True] (its last occurrence): train on the CPU where a GPU is visible. This process then sees
    no GPU (CUDA_VISIBLE_DEVICES=, read by torch when it first looks for one, so that nothing of the run uses one), set
    before anything of the run looks; where something looked already, one line with the variable to set instead."""
    at = [i for i, arg in enumerate(argv) if arg.partition("=")[0].replace("-", "_") == "__use_cpu"]
    if not at:
        return
    name, has_eq, value = argv[at[-1]].partition("=")
    value = value if has_eq else argv[at[-1] + 1] if at[-1] + 1 < len(argv) and not argv[at[-1] + 1].startswith(
        "--") else "true"
    if value.lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"--use_cpu {value}: pass --use_cpu (True) to train on the CPU, or leave it out")
    if value.lower() in ("true", "1"):
        import torch

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if torch.cuda.is_available():
            raise ConfigError("--use_cpu: a GPU was found before the flag was read: set CUDA_VISIBLE_DEVICES= in the "
                              "environment instead (CUDA_VISIBLE_DEVICES= python rloo.py ...)")


def as_given(line: str, argv: Optional[list[str]] = None) -> str:
    """A line that names a flag this script's way (--kl_coef, kl_coef) named as the command line gave it where that
    used TRL >= 0.22's name (--beta), on the command line or as a --config file's key; `argv`: the command line
    (this process's)."""
    argv = sys.argv[1:] if argv is None else argv
    names = {arg[2:].partition("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    at = [i for i, arg in enumerate(argv) if arg.partition("=")[0] == "--config"]
    path = at and (argv[at[0]].partition("=")[2] or (argv[at[0] + 1] if at[0] + 1 < len(argv) else ""))
    with contextlib.suppress(ConfigError):  # the file's own refusal is said by parse_args
        config = read_config(path) if path else None
        names |= {str(key).replace("-", "_") for key in config} if isinstance(config, dict) else set()
    for trl, own in TRL_NAMES.items():
        if trl in names and own not in names:
            line = re.sub(rf"(?<![\w-])(--)?{own}\b", lambda m: (m.group(1) or "") + trl, line)
    return line


def accelerate_quiet() -> Optional[bool]:
    """Whether `accelerate launch`'s single-process launcher (no torchrun inside) started this process with --quiet;
    None when it did not start it. Without --quiet it follows a failed run with its own traceback."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    launch = next((i for i, word in enumerate(words) if word == "launch"), None)
    return None if launch is None else any(word in ("--quiet", "-q") for word in words[launch:])


def say(line: str, argv: Optional[list[str]] = None) -> None:
    """The run's last line (why it ended; stderr), its flags named as given (as_given), and where its launcher shows
    it last: torchrun (and accelerate launch of several processes, which runs torchrun's launcher) ends with its
    summary of the failed ranks, whose `traceback :` entry is the line (the rank's error file, TORCHELASTIC_ERROR_FILE,
    created for it); accelerate launch of one process follows the line with its own traceback, which nothing in the
    process can prevent, so the line names the option that leaves it out."""
    line = as_given(line, argv)
    if accelerate_quiet() is False:
        line += " (accelerate launch's traceback follows it: accelerate launch --quiet leaves that out)"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE") if "TORCHELASTIC_RUN_ID" in os.environ else None
    with contextlib.suppress(OSError):  # never another file: a new one, or nothing
        if path:
            with open(path, "x") as file:  # torchrun's format (the @record decorator's), read by its summary
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, file)


def run_script(main: Callable, args, program: str, end_process: bool = True) -> None:
    """main(args), with bad input (ConfigError) turned into one line on stderr and exit status 2, a non-finite
    value before an optimizer step (NonFiniteError) into one line and exit status 3, a fault that stopped the run
    (Fault) into one line and exit status 4, and a signal before training (or a KeyboardInterrupt before its
    handler is set) into one line and exit status 0 (130 for SIGINT; under torchrun 128 + the signal's number);
    and the process ends then, whatever user code left running (exit_if_left_running; the processes it started are
    ended, end_processes_left), with that status whatever signal comes during the exit (exit_process). The console
    cannot stop it (console_survives). Shared by this project's scripts. `end_process` False: SystemExit is raised
    instead, for a caller that goes on (a test)."""
    console_survives()
    running = {*threading.enumerate(), *multiprocessing.active_children()}  # not of this run (a test's process)
    try:
        say_how_it_ended(main, args, program)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
        exit_if_left_running(status, program, running)
        exit_bounded(program, status)
        if end_process:
            exit_process(status)
        raise
    except BaseException:  # a traceback: Python's own report of it, and its exit status
        if left_running(running):
            sys.excepthook(*sys.exc_info())
            exit_if_left_running(1, program, running)
        exit_bounded(program, 1)
        raise
    for sig in StopSignal.SIGNALS:  # finished: the handlers that only record a signal for the update loop give way,
        if isinstance(getattr(signal.getsignal(sig), "__self__", None), StopSignal):  # so that a signal ends the exit
            signal.signal(sig, signal.SIG_DFL)  # (an atexit handler of user code that hangs)
    exit_if_left_running(0, program, running)
    exit_bounded(program, 0)
    if end_process:
        exit_process(0)


def exit_process(status: int) -> None:
    """The process's exit as Python's, less the interpreter's finalization: the atexit handlers (the output_dir
    lock's release, multiprocessing's end of its children, user code's, each bounded: rewards.ExitHandler, an
    in-process vLLM engine's end), the console flushed, then the exit status. Python's finalization that would follow
    first gives every signal its default action back, then frees every object left (a colocated engine's process:
    seconds of C++ teardown on a busy CPU): torchrun's SIGTERM to the other ranks, once one has failed, then ended a
    rank that had stopped with its fault and status 4 with -15 instead. Nothing of the run is left to it: its files
    are closed by then, and the process's memory, devices and sockets are the kernel's to free."""
    gc.freeze()  # the run is over: the handlers' collections (vLLM's end collects) need not search the models' objects
    atexit._run_exitfuncs()  # what Python's exit runs first (its threads are not waited for: exit_if_left_running)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a console gone (console_survives) or replaced
            stream.flush()
    os._exit(status)


def left_running(running: set) -> list[str]:
    """What Python's exit would wait for, started since `running` and still running: threads that are not daemons
    and multiprocessing's child processes that are not either."""
    return [t.name for t in threading.enumerate() if not t.daemon and t not in running] + [
        f"process {p.pid}" for p in multiprocessing.active_children() if not p.daemon and p not in running]


def exit_if_left_running(status: int, program: str, running: set) -> None:
    """Python's exit waits for every thread left running that is not a daemon (a reward function may start one), and
    for multiprocessing's children that are not either, forever if they never end, deaf to signals: those started
    since `running` are named in one line. The children are ended (SIGTERM, then SIGKILL after 2 s); a thread cannot
    be: then the process exits with `status` at once, its console flushed, atexit handlers not run, its
    multiprocessing children killed (none outlives the run). Returns when no thread is left."""
    left = left_running(running)
    if not left:
        return
    print(f"{program}: exiting with status {status} without waiting for what was left running: {', '.join(left)}",
          file=sys.stderr, flush=True)
    if all(name.startswith("process ") for name in left):  # a daemon pool's workers are left to multiprocessing's end
        for child in multiprocessing.active_children():
            if not child.daemon and child not in running:
                child.terminate()
                child.join(2.0)
                child.kill()
                child.join()
        return
    for child in multiprocessing.active_children():  # what multiprocessing's atexit handler would end or join
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@run_only
def ending(signum, frame) -> None:
    """A stop signal while the run says how it ended: nothing (the exit follows)."""


def say_how_it_ended(main: Callable, args, program: str) -> None:
    """run_script's main(args) and its end said in one line, raising SystemExit with the exit status."""
    try:
        try:
            main(args)
        except BaseException:
            # the run has ended and says how: a stop signal now (torchrun's SIGTERM to the other ranks once one has
            # failed) must not cut that line into a traceback. SIGTERM, SIGUSR1, SIGHUP do nothing, the exit follows;
            # Ctrl-C exits at once. (Not a blocked mask: torch's threads would take the signal for the main thread;
            # not SIG_IGN, which the processes user code starts meanwhile would inherit, a pool's workers included)
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays as it is
                    signal.signal(sig, ending)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            raise
    except ConfigError as e:
        say(f"{program}: error: {shown(e)}")
        sys.exit(2)
    except NonFiniteError as e:
        where = Path(args.output_dir) / "nonfinite"
        say(f"{program}: error: {shown(e)}: stopped before any optimizer step on it; the offending batch " + (
            f"is in {inert(where, 200)}" if e.unwritten is None else
            f"could not be written to {inert(where, 200)} ({e.unwritten})"))
        sys.exit(3)
    except Fault as e:
        if e.announce:
            say(f"{program}: error: {shown(e)}")
        sys.exit(4)
    except KeyboardInterrupt:  # Ctrl-C before the stop signals' handler is in place (a reward module's import)
        print(f"{program}: SIGINT received while starting: stopped, nothing trained; run the same command again",
              file=sys.stderr)
        sys.exit(130)
    except StartupInterrupted as e:
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            print(f"{program}: {shown(e)}", file=sys.stderr)
            sys.exit(130 if e.signal_name == "SIGINT" else 0)
        # under torchrun the rank that got it says so and fails: an exit 0 would leave a rank that did not get it
        # waiting for this one, and torchrun stops the others when one fails, with a SIGTERM of its own that may
        # reach them while they are still starting: those say nothing (a rank has said why already)
        if not stopped_alone():
            print(f"{program}: rank {os.environ['RANK']}: {shown(e)}", file=sys.stderr, flush=True)
        stopped_alone(mark=True)
        end_processes_left(program, at_once=True)
        os._exit(128 + signal.Signals[e.signal_name])  # not sys.exit: no process group teardown that waits
    except RuntimeError as e:  # under torchrun, a collective cut short by a rank that is gone: one line, not a trace
        frames = traceback.extract_tb(e.__traceback__)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "torch/distributed/" not in frames[-1].filename:
            raise
        if not stopped_alone():  # else that rank has said why already
            print(f"{program}: rank {os.environ['RANK']}: error: a collective failed (a rank stopped, was lost or "
                  f"timed out): {first_line(e)}", file=sys.stderr, flush=True)
        end_processes_left(program, at_once=True)
        os._exit(4)
    finally:  # however it ended: the processes user code left running end with it (they may hold the console)
        end_processes_left(program)


def run_tool(program: str, target: Callable, main: Optional[Callable] = None, argv: Optional[list[str]] = None,
             end_process: bool = True) -> None:
    """A helper script's command line and end, behind rloo.py's boundary: tyro parses `target` (a dataclass, which
    `main` then gets; or a function, called with its flags), a parse error is one line and exit status 2
    (parse_error_line), and the rest ends as a run does (run_script: bad input one line, exit 2; a file that
    cannot be read or written one line, exit 4; `end_process` as run_script's)."""
    flags = [f"--{name}" for name in inspect.signature(target).parameters]

    def parsed_and_run(argv: Optional[list[str]]) -> None:
        try:
            with tyro._errors.on_parse_error(raise_parse_error(flags)):
                parsed = tyro.cli(target, args=argv, prog=program)
            if main is not None:
                main(parsed)
        except OSError as e:  # a file it reads or writes: the disk, a permission, a path through a file
            raise Fault(describe(e)) from None

    run_script(parsed_and_run, argv, program, end_process)


def write_generated(path: Path, text: str, check: bool, wrote: str) -> None:
    """A file a script generates (docs/flags.md, TRL's defaults): written, then `wrote` printed; or with `check`,
    nothing written and exit status 1 where the file is not `text`. Its path is the script's own, in the
    repository: a symbolic link or another kind of file planted there is refused in one line, never written
    through (write_own)."""
    if check:
        sys.exit(0 if path.exists() and path.read_text() == text else 1)
    problem = "is a symbolic link" if path.is_symlink() else not_a_file(path) if path.exists() else None
    if problem:
        raise ConfigError(f"{inert(path, 120)} {problem}, which is never written through: put the repository's file "
                          "back (git checkout -- PATH), then run this again")
    write_own(path, text)
    print(wrote)
