"""TRL 1.16 parity: clip-higher, TRL 1.x's metrics, --mask_truncated_completions, TR-DPO's reference sync, the Trainer's
and the `trl rloo` script's names, and TRL 1.16's whole RLOOConfig field list against both scripts' parsers."""

import dataclasses
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import plumbing
import rloo
import rloo_multinode
from conftest import (policy_loss_of, policy_tokenizer, prompt_rows, read_metrics, run_rloo, tiny_policy,
                      tiny_reward_model)
from helpers import NO_AUTOCAST, REPO, hub_cache_repo, left_padded, python, script_env

CPU = torch.device("cpu")

# ---------------------------------------------------------------- TRL 1.16's RLOOConfig, field by field
# Written out from TRL 1.16's RLOOConfig (its own fields, then the TrainingArguments fields a copied command carries)
# and its `trl rloo` script's ModelConfig / ScriptArguments; never imported from TRL. Each: the command-line values
# given, then what rloo.py's parser must make of them: (own field, value) or REFUSED (one line, exit status 2).
REFUSED, NOOP = "refused", "accepted, changing nothing"  # NOOP: a value that says what rloo.py always does
SAMPLING = {"num_generations_eval", "generation_batch_size", "top_p", "top_k", "min_p", "repetition_penalty",
            "log_completions", "num_completions_to_print"}  # built beside the sampler (the sampling options)
ENGINES = {"use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
           "vllm_server_timeout", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
           "vllm_model_impl"}
RLOO_CONFIG = {  # TRL 1.16 RLOOConfig's own fields
    "model_init_kwargs": (['{"dtype": "bfloat16"}'], REFUSED),
    "trust_remote_code": (["True"], ("trust_remote_code", True)),
    "router_aux_loss_coef": (["0.001"], REFUSED),
    "disable_dropout": (["True"], NOOP),  # what rloo.py always does: accepted, changes nothing
    "num_generations": (["4"], ("rloo_k", 4)),
    "num_generations_eval": (["2"], ("num_generations_eval", 2)),
    "max_completion_length": (["64"], ("response_length", 64)),
    "ds3_gather_for_generation": (["False"], REFUSED),
    "shuffle_dataset": (["False"], REFUSED),
    "pad_to_multiple_of": (["8"], REFUSED),
    "generation_batch_size": (["16"], ("generation_batch_size", 16)),
    "steps_per_generation": (["4"], ("num_mini_batches", 4)),
    "temperature": (["0.9"], ("temperature", 0.9)),
    "top_p": (["0.9"], ("top_p", 0.9)),
    "top_k": (["50"], ("top_k", 50)),
    "min_p": (["0.05"], ("min_p", 0.05)),
    "generation_kwargs": (['{"do_sample": true}'], REFUSED),
    "chat_template_kwargs": (['{"enable_thinking": false}'], REFUSED),
    "repetition_penalty": (["1.1"], ("repetition_penalty", 1.1)),
    "cache_implementation": (["static"], REFUSED),
    "use_vllm": (["True"], ("engine", "vllm")),
    "vllm_mode": (["server"], ("vllm_mode", "server")),  # TRL's default colocate: asks for nothing in rloo.py
    "vllm_model_impl": (["transformers"], REFUSED),
    "vllm_enable_sleep_mode": (["True"], ("vllm_enable_sleep_mode", True)),
    "vllm_structured_outputs_regex": (["a+"], REFUSED),
    "vllm_server_base_url": (["http://10.0.0.2:8000"], ("engine_urls", "http://10.0.0.2:8000")),
    "vllm_server_host": (["10.0.0.3"], ("engine_urls", "http://10.0.0.3:8000")),
    "vllm_server_port": (["8001"], ("engine_urls", "http://0.0.0.0:8001")),
    "vllm_server_timeout": (["120"], ("engine_timeout", 120.0)),
    "vllm_group_port": (["51217"], REFUSED),
    "vllm_gpu_memory_utilization": (["0.5"], ("vllm_gpu_memory_utilization", 0.5)),
    "vllm_max_model_length": (["1024"], REFUSED),
    "vllm_tensor_parallel_size": (["2"], ("vllm_tensor_parallel_size", 2)),
    "beta": (["0.03"], ("kl_coef", 0.03)),
    "num_iterations": (["2"], ("num_ppo_epochs", 2)),
    "epsilon": (["0.1"], ("cliprange", 0.1)),
    "epsilon_high": (["0.28"], ("epsilon_high", 0.28)),
    "reward_weights": (["1.0", "0.5"], ("reward_weights", (1.0, 0.5))),
    "normalize_advantages": (["True"], ("normalize_advantage", True)),
    "reward_clip_range": (["-1", "1"], REFUSED),  # TRL's (min, max) of raw rewards; here one number, another meaning
    "mask_truncated_completions": (["True"], ("mask_truncated_completions", True)),
    "sync_ref_model": (["True"], ("sync_ref_model", True)),
    "ref_model_mixup_alpha": (["0.9"], ("ref_model_mixup_alpha", 0.9)),
    "ref_model_sync_steps": (["64"], ("ref_model_sync_steps", 64)),
    "log_completions": (["True"], ("log_completions", True)),
    "log_multimodal": (["True"], NOOP),  # text only: accepted, nothing to log
    "num_completions_to_print": (["3"], ("num_completions_to_print", 3)),
    "log_unique_prompts": (["True"], REFUSED),
    "use_transformers_continuous_batching": (["True"], REFUSED),
    "transformers_continuous_batching_config": (['{"block_size": 128}'], REFUSED),
    "use_transformers_paged": (["True"], REFUSED),
}
TRAINING_ARGUMENTS = {  # transformers' TrainingArguments, as RLOOConfig inherits them
    "output_dir": (["runs/x"], ("output_dir", "runs/x")),
    "overwrite_output_dir": (["True"], ("overwrite_output_dir", True)),
    "do_train": (["True"], NOOP),
    "do_eval": (["True"], REFUSED),
    "eval_strategy": (["steps"], ("eval_strategy", "steps")),
    "eval_steps": (["100"], ("eval_steps", 100)),
    "per_device_train_batch_size": (["4"], ("per_device_train_batch_size", 4)),
    "per_device_eval_batch_size": (["4"], REFUSED),
    "gradient_accumulation_steps": (["2"], ("gradient_accumulation_steps", 2)),
    "learning_rate": (["1e-6"], ("learning_rate", 1e-6)),
    "weight_decay": (["0.1"], ("weight_decay", 0.1)),
    "adam_beta1": (["0.9"], NOOP),
    "adam_beta2": (["0.95"], REFUSED),
    "adam_epsilon": (["1e-6"], ("adam_epsilon", 1e-6)),
    "max_grad_norm": (["0.5"], ("max_grad_norm", 0.5)),
    "num_train_epochs": (["2"], ("num_train_epochs", 2.0)),
    "max_steps": (["100"], ("max_steps", 100)),
    "lr_scheduler_type": (["constant"], ("lr_scheduler_type", "constant")),
    "lr_scheduler_kwargs": (['{"min_lr": 0}'], REFUSED),
    "warmup_ratio": (["0.1"], ("warmup_ratio", 0.1)),
    "warmup_steps": (["10"], ("warmup_steps", 10)),
    "logging_dir": (["logs"], REFUSED),
    "logging_strategy": (["steps"], NOOP),
    "logging_first_step": (["True"], REFUSED),
    "logging_steps": (["0.1"], ("logging_steps", 0.1)),
    "save_strategy": (["no"], ("save_strategy", "no")),
    "save_steps": (["50"], ("save_steps", 50)),
    "activation_checkpointing": (["True"], ("gradient_checkpointing", True)),
    "save_total_limit": (["2"], ("save_total_limit", 2)),
    "save_only_model": (["True"], REFUSED),
    "seed": (["42"], ("seed", 42)),
    "data_seed": (["42"], REFUSED),
    "full_determinism": (["True"], REFUSED),
    "bf16": (["True"], ("bf16", True)),
    "fp16": (["True"], REFUSED),
    "tf32": (["True"], REFUSED),
    "local_rank": (["0"], REFUSED),
    "ddp_timeout": (["1800"], ("ddp_timeout", 1800.0)),
    "ddp_find_unused_parameters": (["True"], REFUSED),
    "dataloader_num_workers": (["4"], REFUSED),
    "run_name": (["tldr"], ("run_name", "tldr")),
    "disable_tqdm": (["True"], REFUSED),
    "remove_unused_columns": (["True"], REFUSED),
    "label_names": (["labels"], REFUSED),
    "report_to": (["wandb"], ("track", True)),
    "deepspeed": (["zero3.json"], REFUSED),
    "fsdp": (["full_shard auto_wrap"], ("fsdp", True)),
    "fsdp_config": (["fsdp.json"], REFUSED),
    "gradient_checkpointing": (["True"], ("gradient_checkpointing", True)),
    "gradient_checkpointing_kwargs": (['{"use_reentrant": false}'], REFUSED),
    "push_to_hub": (["True"], REFUSED),
    "hub_model_id": (["me/model"], REFUSED),
    "hub_strategy": (["end"], REFUSED),
    "resume_from_checkpoint": (["runs/x/checkpoints/step_2"], ("resume_from", "runs/x/checkpoints/step_2")),
    "optim": (["adamw_torch"], NOOP),
    "torch_compile": (["True"], REFUSED),
    "use_liger_kernel": (["True"], REFUSED),
    "eval_on_start": (["True"], NOOP),
    "include_num_input_tokens_seen": (["True"], REFUSED),
    "average_tokens_across_devices": (["False"], REFUSED),
}
TRL_RLOO_SCRIPT = {  # the `trl rloo` script's ModelConfig and ScriptArguments
    "model_name_or_path": (["models/policy"], ("model_name_or_path", "models/policy")),
    "model_revision": (["v1.0"], ("model_revision", "v1.0")),
    "dtype": (["bfloat16"], REFUSED),
    "torch_dtype": (["bfloat16"], REFUSED),
    "attn_implementation": (["eager"], ("attn_implementation", "eager")),
    "use_peft": (["True"], ("use_peft", True)),
    "lora_r": (["8"], ("lora_r", 8)),
    "lora_alpha": (["16"], ("lora_alpha", 16)),
    "lora_dropout": (["0.05"], ("lora_dropout", 0.05)),
    "lora_target_modules": (["q_proj", "v_proj"], ("lora_target_modules", ("q_proj", "v_proj"))),
    "lora_modules_to_save": (["lm_head"], ("lora_modules_to_save", ("lm_head",))),
    "lora_target_parameters": (["mlp.experts.gate_up_proj"], ("lora_target_parameters", ("mlp.experts.gate_up_proj",))),
    "lora_task_type": (["SEQ_CLS"], REFUSED),
    "use_rslora": (["True"], ("use_rslora", True)),
    "use_dora": (["True"], ("use_dora", True)),
    "load_in_8bit": (["True"], REFUSED),
    "load_in_4bit": (["True"], ("load_in_4bit", True)),
    "bnb_4bit_quant_type": (["fp4"], ("bnb_4bit_quant_type", "fp4")),
    "use_bnb_nested_quant": (["True"], ("use_bnb_nested_quant", True)),
    "bnb_4bit_quant_storage": (["bfloat16"], ("bnb_4bit_quant_storage", "bfloat16")),
    "dataset_name": (["trl-lib/ultrafeedback-prompt"], ("dataset_name", "trl-lib/ultrafeedback-prompt")),
    "dataset_config": (["default"], ("dataset_config", "default")),
    "dataset_train_split": (["train"], ("dataset_train_split", "train")),
    "dataset_test_split": (["test"], ("dataset_test_split", "test")),
    "dataset_streaming": (["True"], REFUSED),
    "dataset_num_proc": (["4"], REFUSED),
    "gradient_checkpointing_use_reentrant": (["True"], REFUSED),
    "ignore_bias_buffers": (["True"], REFUSED),
    "reward_model_name_or_path": (["models/rm"], ("reward_model_path", "models/rm")),
    "reward_funcs": (["my_rewards.lengths.reward_len"], ("reward_fn", ("my_rewards.lengths:reward_len",))),
    "datasets": (['{"path": "trl-lib/tldr"}'], REFUSED),  # DatasetMixtureConfig's
    "streaming": (["True"], REFUSED),
    "test_split_size": (["0.1"], REFUSED),
}
TRL_FIELDS = RLOO_CONFIG | TRAINING_ARGUMENTS | TRL_RLOO_SCRIPT


# Every field of transformers' TrainingArguments (5.19, which RLOOConfig extends), written out: each one missing from
# the table above is one a copied command rarely carries, and must parse or be refused in one line all the same.
TRANSFORMERS_TRAINING_ARGUMENTS = """
output_dir per_device_train_batch_size num_train_epochs max_steps learning_rate lr_scheduler_type lr_scheduler_kwargs
warmup_steps optim optim_args weight_decay adam_beta1 adam_beta2 adam_epsilon optim_target_modules
gradient_accumulation_steps average_tokens_across_devices max_grad_norm label_smoothing_factor bf16 fp16
bf16_full_eval fp16_full_eval tf32 gradient_checkpointing gradient_checkpointing_kwargs torch_compile
torch_compile_backend torch_compile_mode use_liger_kernel liger_kernel_config use_cache neftune_noise_alpha
torch_empty_cache_steps auto_find_batch_size logging_strategy logging_steps logging_first_step log_on_each_node
logging_nan_inf_filter include_num_input_tokens_seen log_level log_level_replica disable_tqdm report_to run_name
project trackio_space_id trackio_bucket_id trackio_static_space_id eval_strategy eval_steps eval_delay
per_device_eval_batch_size prediction_loss_only eval_on_start eval_do_concat_batches eval_use_gather_object
eval_accumulation_steps include_for_metrics batch_eval_metrics save_only_model save_strategy save_steps
save_on_each_node save_total_limit enable_jit_checkpoint push_to_hub hub_token hub_private_repo hub_model_id
hub_strategy hub_always_push hub_revision load_best_model_at_end metric_for_best_model greater_is_better
ignore_data_skip restore_callback_states_from_checkpoint full_determinism seed data_seed use_cpu accelerator_config
parallelism_config dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers
dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order remove_unused_columns label_names
train_sampling_strategy length_column_name ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers
ddp_static_graph ddp_backend ddp_timeout fsdp fsdp_config deepspeed debug skip_memory_metrics do_train do_eval
do_predict resume_from_checkpoint local_rank
""".split()


def test_the_tables_above_hold_every_field_of_trl_1_16s_table():
    """The tables written out here against plumbing.TRL116, read from TRL 1.16's dataclasses (the `trl rloo` parser's
    RLOOConfig, ModelConfig, script and dataset arguments): a field TRL adds is a case here first."""
    assert set(plumbing.TRL116) - set(TRL_FIELDS) - set(TRANSFORMERS_TRAINING_ARGUMENTS) == set()


@pytest.mark.parametrize("script", ["rloo.py", "rloo_multinode.py"])
def test_every_training_arguments_field_parses_or_is_refused_in_one_line(script, capsys, monkeypatch):
    cls = rloo.Args if script == "rloo.py" else rloo_multinode.Args
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))  # --use_cpu 1 sets it
    for name in TRANSFORMERS_TRAINING_ARGUMENTS:
        if name in TRL_FIELDS:
            continue  # checked value by value above
        args, refusal = parse_or_refusal(cls, [f"--{name}", "1"], script, capsys)
        assert args is not None or (refusal.count("\n") == 1 and refusal.startswith(f"{script}: error: --{name}")
                                    and "Unrecognized" not in refusal), (name, refusal)


def parse_or_refusal(cls, argv: list[str], prog: str, capsys) -> tuple[object, str]:
    """(the parsed Args, '') or (None, the refusal's stderr)."""
    try:
        return plumbing.parse_args(cls, argv=argv, prog=prog), ""
    except SystemExit as e:
        assert e.code == 2
        return None, capsys.readouterr().err


def batches(entries: dict) -> list[dict]:
    """The accepted entries in as few command lines as can hold them: no two setting the same flag (a parse costs
    about a second on a busy machine); --steps_per_generation, which reads --gradient_accumulation_steps, alone."""
    out: list[dict] = []
    for name, (values, expected) in entries.items():
        target = None if expected == NOOP else expected[0]
        home = next((b for b in out if name != "steps_per_generation" and "steps_per_generation" not in b
                     and target not in {None if e == NOOP else e[0] for _, e in b.values()} | {"engine_urls"}), None)
        if home is None or target == "engine_urls":
            out.append(home := {})
        home[name] = (values, expected)
    return out


@pytest.mark.parametrize("script", ["rloo.py", "rloo_multinode.py"])
def test_every_trl_1_16_field_parses_to_its_flag_or_is_refused_in_one_line(script, capsys):
    cls = rloo.Args if script == "rloo.py" else rloo_multinode.Args
    names = {f for f in cls.__dataclass_fields__}
    accepted = {}
    for name, (values, expected) in TRL_FIELDS.items():
        if name in SAMPLING and name not in names:
            continue  # the sampling options' own branch adds them
        if expected != REFUSED and not (script == "rloo.py" and name in ENGINES):
            accepted[name] = (values, expected)
            continue
        for spelling in (f"--{name}", f"--{name.replace('_', '-')}"):
            args, refusal = parse_or_refusal(cls, [spelling, *values], script, capsys)
            assert args is None, (script, name)
            assert refusal.count("\n") == 1 and refusal.startswith(f"{script}: error: --{name}"), refusal
            assert "Unrecognized" not in refusal and "╭" not in refusal  # a reason, not tyro's box
            if script == "rloo.py" and name in ENGINES:
                assert "rloo_multinode.py" in refusal
    for i, batch in enumerate(batches(accepted)):
        argv = [arg for name, (values, _) in batch.items()
                for arg in (f"--{name if i % 2 else name.replace('_', '-')}", *values)]  # both spellings
        args, refusal = parse_or_refusal(cls, argv, script, capsys)
        assert args is not None, (script, argv, refusal)
        for name, (_, expected) in batch.items():
            if expected != NOOP:
                assert getattr(args, expected[0]) == expected[1], (script, name, getattr(args, expected[0]))


def test_trl_forms_of_values():
    parse = lambda *argv: plumbing.parse_args(rloo.Args, argv=list(argv))  # noqa: E731
    assert parse("--bf16", "False").bf16 is False and parse("--bf16=true").bf16 is True
    assert parse("--report_to", "none", "--track").track is True  # the last wins, as argparse's
    assert parse("--report_to", "none").track is False
    assert parse("--resume_from_checkpoint", "True").resume is True
    assert parse("--reward_funcs", "a.b", "c.d.e").reward_fn == ("a:b", "c.d:e")
    assert parse("--disable_dropout").rloo_k == 2 and parse("--dtype", "float32").rloo_k == 2
    assert parse("--model_revision", "main").rloo_k == 2
    m = plumbing.parse_args(rloo_multinode.Args, argv=["--vllm_server_host", "10.1.1.1", "--vllm_server_port", "9"])
    assert m.engine_urls == "http://10.1.1.1:9"


@pytest.mark.parametrize("argv,message", [
    (["--reward_funcs", "accuracy_reward"], "TRL's built-in reward functions are not here"),
    (["--report_to", "mlflow"], "pass --report_to wandb, tensorboard (or both) or none"),
    (["--dtype", "float16"], "fp32 master weights"),
    (["--dtype=bfloat16"], "pass --bf16 instead"),
    (["--torch_dtype", "bfloat16"], "pass --bf16 instead"),
    (["--load_in_8bit"], "--load_in_4bit with --use_peft"),
    (["--fsdp", "shard_grad_op"], "--fsdp shards weights, gradients and optimizer state"),
])
def test_trl_values_with_no_meaning_here_are_refused_with_the_reason(argv, message, capsys):
    args, refusal = parse_or_refusal(rloo.Args, argv, "rloo.py", capsys)
    assert args is None and refusal.count("\n") == 1 and message in refusal, refusal


def test_use_vllm_false_in_rloo_multinode_names_rloo_py(capsys):
    args, refusal = parse_or_refusal(rloo_multinode.Args, ["--use_vllm", "False"], "rloo_multinode.py", capsys)
    assert args is None and "rloo.py's" in refusal


def test_use_vllm_without_vllm_mode_is_colocated_as_in_trl_1_16(capsys):
    """TRL 1.16's RLOOConfig.vllm_mode defaults to colocate; rloo_multinode.py's own --vllm_mode to server."""
    parse = lambda *argv: plumbing.parse_args(rloo_multinode.Args, argv=list(argv), prog="rloo_multinode.py")  # noqa
    for argv in (["--use_vllm"], ["--use_vllm", "True"], ["--use-vllm=true"], ["--use_vllm", "1"]):
        assert (parse(*argv).engine, parse(*argv).vllm_mode) == ("vllm", "colocate"), argv
    for argv in (["--use_vllm", "--vllm_mode", "server"], ["--vllm-mode=server", "--use_vllm", "True"]):
        assert parse(*argv).vllm_mode == "server", argv
    assert parse().vllm_mode == "server" and parse("--engine", "vllm").vllm_mode == "server"  # the script's own
    assert parse("--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", "http://h:8000/").engine_urls == \
        "http://h:8000"
    for server in (["--vllm_server_base_url", "http://h:8000"], ["--vllm_server_port=8001"]):
        args, refusal = parse_or_refusal(rloo_multinode.Args, ["--use_vllm", *server], "rloo_multinode.py", capsys)
        assert args is None and refusal.count("\n") == 1 and "add --vllm_mode server" in refusal, refusal


# ---------------------------------------------------------------- the `trl rloo` script's model options
def hub_model(root: Path, revisions: dict) -> None:
    """A model in the tests' Hugging Face cache (its folder `root`), one snapshot per {ref: seed} (a policy and its
    tokenizer), as downloads of those revisions leave it."""
    for i, (ref, seed) in enumerate(revisions.items()):
        commit = str(i + 1) * 40
        tiny_policy(len(policy_tokenizer()), seed=seed).save_pretrained(root / "snapshots" / commit)
        policy_tokenizer().save_pretrained(root / "snapshots" / commit)
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)


def test_model_revision_loads_that_revision_of_a_hub_policy_and_takes_part_in_its_identity(tmp_path):
    """The policy (and its tokenizer, reference and fingerprint for resume) come from --model_revision's snapshot;
    a revision the cache lacks is one line."""
    model, root = hub_cache_repo(tmp_path.name)
    hub_model(root, {"main": 0, "v1": 1})
    code = (f"import json, sys, torch, plumbing, rloo; args = rloo.Args(model_name_or_path={model!r}, reward_fn="
            "('m:f',), model_revision=sys.argv[1]); plumbing.validate_args(args); policy, ref, _, _ = "
            "rloo.load_policy(args, torch.device('cpu')); print(json.dumps({'weights': policy.gpt_neox.embed_in.weight"
            "[:2, :2].tolist(), 'reference': torch.equal(ref.gpt_neox.embed_in.weight, policy.gpt_neox.embed_in."
            "weight), 'identity': plumbing.input_identities(args)['model_name_or_path']}))")
    seen = {}
    for revision in ("main", "v1", "missing"):
        result = subprocess.run([python(), "-c", code, revision], capture_output=True, text=True, cwd=REPO,
                                env=script_env())
        if revision == "missing":
            assert result.returncode != 0 and "could not load" in result.stderr and model in result.stderr
            continue
        assert result.returncode == 0, result.stderr[-2000:]
        seen[revision] = json.loads(result.stdout.splitlines()[-1])
    for revision, seed, commit in (("main", 0, "1" * 40), ("v1", 1, "2" * 40)):
        assert seen[revision]["weights"] == tiny_policy(len(policy_tokenizer()), seed).gpt_neox.embed_in.weight[
            :2, :2].tolist()
        assert seen[revision]["identity"]["revision"] == commit and seen[revision]["reference"]


@pytest.mark.parametrize("flags,message", [
    (["--model_revision", "v1"], "is a local path, which has no revisions"),
    (["--model_revision=", "--model_name_or_path", "org/tiny"], "--model_revision is empty"),
    (["--model_revision", " ", "--model_name_or_path", "org/tiny"], "--model_revision is empty"),
    (["--model_revision=v1", "--model_name_or_path", "org/tiny", "--sft_model_path", "POLICY"], "--sft_model_path"),
    (["--model_revision", "v1", "--model_name_or_path", "org/tiny", "--reward_model_path", "org/rm"],
     "TRL loads a reward model named by Hub id"),
    (["--attn_implementation", "flash_attention_2"], "takes no 4D mask"),
    (["--attn_implementation=flash_attention_3"], "takes no 4D mask"),
    (["--attn_implementation", "flex_attention"], "crashed"),
    (["--attn_implementation", "kernels-community/flash-attn"], "code chosen by the network"),
    (["--attn_implementation", "sdpa_typo"], "not one of transformers' attention implementations"),
    (["--load_in_4bit", "True"], "add --use_peft"),
    (["--bnb_4bit_quant_type", "fp4"], "add --load_in_4bit"),
])
def test_model_options_that_cannot_work_are_one_line_before_models_load(assets, tmp_path, flags, message):
    out = tmp_path / "out"
    argv = [str(assets["policy"]) if flag == "POLICY" else flag for flag in flags]
    if "--model_name_or_path" not in argv:
        argv += ["--model_name_or_path", assets["policy"]]
    result = run_rloo(*argv, "--reward_fn", "reward_fns:count_a", "--dataset_name", assets["train"], "--output_dir", out)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "loaded the" not in result.stdout and not out.exists()


def test_bad_choices_of_the_4bit_options_are_one_line(capsys):
    args, refusal = parse_or_refusal(rloo.Args, ["--bnb_4bit_quant_type", "int4"], "rloo.py", capsys)
    assert args is None and refusal.count("\n") == 1 and "--bnb_4bit_quant_type" in refusal, refusal


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attn_implementation_reaches_both_models_and_prompt_sharing_passes_its_check(assets, implementation):
    args = rloo.Args(model_name_or_path=str(assets["policy"]), reward_model_path=str(assets["reward_model"]),
                     attn_implementation=implementation, max_prompt_length=16, response_length=6)
    plumbing.validate_args(args)
    policy, ref, tokenizer, _ = rloo.load_policy(args, CPU)
    sources = plumbing.load_reward_sources(args, tokenizer, [], CPU)
    probe = rloo.Completions(**plumbing.sharing_probe(list(range(2, 14)), 12, 6, CPU))
    notes = []
    for model, name, compute in ((policy, "policy", lambda c, share: rloo.forward_logprobs(
                                      policy, c, 1.0, share)[0][c.response_mask]),
                                 (ref, "policy", lambda c, share: rloo.forward_logprobs(
                                      ref, c, 1.0, share)[0][c.response_mask]),
                                 (sources.model, "reward model",
                                  lambda c, share: rloo.reward_model_scores(sources.model, c, share))):
        assert plumbing.attention_implementation(model) == implementation
        assert plumbing.shares_prompts(model, name, None, probe, compute, notes), notes


def test_save_and_logging_steps_count_updates_or_with_max_steps_optimizer_steps():
    """TRL <= 0.21's unit (updates) by default; with --max_steps, TRL >= 0.22's (optimizer steps), as max_steps;
    below 1, TRL's share of the run (here in whole updates, rounded up)."""
    args = lambda **flags: rloo.Args(**{"save_steps": 8, "logging_steps": 6, **flags})  # noqa: E731
    run = plumbing.RunLength
    assert plumbing.update_intervals(args(), run(40, 4)) == (8, 6)  # every 8th update, a line every 6th
    assert plumbing.update_intervals(args(max_steps=16), run(4, 4)) == (2, {2, 3})  # the updates reaching 6, 12
    assert plumbing.update_intervals(args(max_steps=16), run(16, 1)) == (8, 6)
    assert plumbing.update_intervals(rloo.Args(max_steps=16), run(4, 4)) == (0, 1)  # defaults: at the end; every update
    with pytest.raises(plumbing.ConfigError, match="pass a multiple of 4"):
        plumbing.update_intervals(args(max_steps=16, save_steps=6), run(4, 4))
    assert plumbing.update_intervals(args(save_steps=0.25, logging_steps=0.1), run(30, 4)) == (8, 3)  # ceil 7.5, 3
    assert plumbing.update_intervals(args(save_steps=0.5, logging_steps=0.5, max_steps=12), run(3, 4)) == (2, {2, 3})
    trl116 = args(trl_defaults="1.16")  # TRL 1.16's units without --max_steps too, and shares of its optimizer steps
    assert plumbing.update_intervals(trl116, run(10, 4)) == (2, {2, 3, 5, 6, 8, 9})  # steps 6, 12, ..., 36
    assert plumbing.update_intervals(dataclasses.replace(trl116, save_steps=0.5, logging_steps=0.3), run(8, 2, 15)) \
        == (4, {3, 5, 8})  # ceil(7.5) = 8 steps: update 4; every ceil(4.5) = 5 steps: 5, 10, 15


def test_with_max_steps_a_run_saves_and_logs_at_trls_optimizer_steps(assets, tmp_path):
    """12 optimizer steps of 4 per update (2 epochs x 2 minibatches): 3 updates; --save_steps 8 is every 2nd update
    (and the last), --logging_steps 8 the console line at updates 2 and 3 (the last)."""
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--reward_fn",
              "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "8", "--num_ppo_epochs", "2",
              "--num_mini_batches", "2", "--response_length", "4", "--max_prompt_length", "16", "--num_evals", "0",
              "--num_sample_generations", "0", "--max_steps", "12"]
    result = run_rloo(*common, "--save_steps", "8", "--logging_steps", "8", "--output_dir", tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("update ")] == ["2/3,", "3/3,"]
    assert len(read_metrics(tmp_path / "out")) == 3
    result = run_rloo(*common, "--save_steps", "6", "--output_dir", tmp_path / "other")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "pass a multiple of 4" in result.stderr
    assert not (tmp_path / "other" / "checkpoints").exists()


# ---------------------------------------------------------------- the algorithm's flag checks, beside Args
@pytest.mark.parametrize("flags,message", [
    ({"epsilon_high": float("nan")}, "epsilon_high = nan must be"),
    ({"epsilon_high": 0.0}, "epsilon_high = 0.0 must be"),
    ({"ref_model_mixup_alpha": 1.5, "sync_ref_model": True}, "ref_model_mixup_alpha = 1.5 must be in [0, 1]"),
    ({"ref_model_sync_steps": 0}, "ref_model_sync_steps = 0 must be at least 1"),
    ({"sync_ref_model": True, "kl_coef": 0.0}, "with kl_coef 0 there is no reference"),
    ({"sync_ref_model": True, "use_peft": True}, "the reference is the policy's own base"),
    ({"sync_ref_model": True, "fsdp": True}, "--sync_ref_model with --fsdp is not supported"),
    ({"mask_truncated_completions": True, "stop_token": None}, "--mask_truncated_completions drops completions"),
    ({"max_steps": 8, "total_episodes": 64}, "pass one of them"),
    ({"warmup_ratio": 1.5}, "warmup_ratio = 1.5 must be in [0, 1]"),
    ({"save_strategy": "no", "save_steps": 5}, "--save_strategy no but --save_steps 5"),
    ({"use_dora": True}, "--use_dora is an option of LoRA adapters: add --use_peft"),
    ({"lora_target_parameters": ("w",)}, "--lora_target_parameters is an option of LoRA adapters: add --use_peft"),
    ({"bnb_4bit_quant_storage": "bfloat16"}, "--bnb_4bit_quant_storage is an option of the 4-bit base"),
    ({"eval_strategy": "steps"}, "--eval_strategy steps evaluates on --dataset_test_split"),
    ({"eval_strategy": "no", "dataset_test_split": "t"}, "--eval_strategy no, but --dataset_test_split t"),
    ({"eval_steps": 5}, "--eval_steps 5 spaces the evaluations of --eval_strategy steps"),
    ({"logging_steps": 2.5}, "logging_steps = 2.5 must be a whole number >= 1, or a share of the run"),
    ({"save_steps": 1.0001}, "save_steps = 1.0001 must be"),
    ({"eval_steps": 0, "eval_strategy": "steps", "dataset_test_split": "t"}, "eval_steps = 0 must be"),
    ({"weight_decay": -0.1}, "weight_decay = -0.1 must be in [0, "),
])
def test_clashing_algorithm_flags_are_refused(flags, message):
    with pytest.raises(plumbing.ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        plumbing.validate_args(rloo.Args(model_name_or_path="p", reward_fn=("m:f",), **flags))


@pytest.mark.parametrize("flags", [{"num_ppo_epochs": 4}, {"num_ppo_epochs": 2, "generation_batch_size": 24,
                                                             "per_device_train_batch_size": 4}])
def test_max_steps_not_a_multiple_of_an_updates_steps_is_refused(flags):
    """6 steps cannot be whole updates of 4 epochs x 1 minibatch, nor of 2 epochs x 6 minibatches
    (--generation_batch_size 24 / micro-batch 4)."""
    args = rloo.Args(model_name_or_path="p", reward_fn=("m:f",), max_steps=6, **flags)
    plumbing.validate_args(args)
    sizes = rloo.compute_batch_sizes(args, 1)
    with pytest.raises(plumbing.ConfigError, match="--max_steps 6 is not a multiple of an update's optimizer steps .*"
                                                   r"or --num_iterations 1 \(TRL 1.16's default\), or --trl_defaults"):
        plumbing.run_length(args, 256, sizes.all_ranks, args.num_ppo_epochs * sizes.minibatches)


def test_the_algorithm_rules_live_beside_args():
    """rloo.algorithm_rules holds the algorithm's numbers, plumbing.number_rules the run's: no flag in both."""
    args = rloo.Args()
    algorithm = {name for name, *_ in rloo.algorithm_rules(args)}
    run = {name for name, *_ in plumbing.number_rules(args)}
    assert not algorithm & run
    assert {"cliprange", "epsilon_high", "kl_coef", "temperature", "ref_model_mixup_alpha"} <= algorithm
    assert not {f for f in algorithm if f in plumbing.RunArgs.__dataclass_fields__}


# ---------------------------------------------------------------- clip-higher and clip_ratio/*, by hand
RATIOS = [0.7, 1.1, 1.25, 1.4, 1.4]
ADVANTAGES = [-1.0, 1.0, 1.0, 1.0, -1.0]


def hand_loss(cliprange_high=None, in_loss=None):
    new = torch.tensor(RATIOS).log()[:, None]  # (5, 1): one token each, so the sequence ratio is the token's
    return policy_loss_of(new, torch.zeros(5, 1), torch.tensor(ADVANTAGES), torch.ones(5, 1, dtype=torch.bool),
                            0.2, per_token=False, epsilon_high=cliprange_high, in_loss=in_loss)


def test_clip_higher_clips_the_ratio_to_1_minus_epsilon_and_1_plus_epsilon_high():
    losses, stats = hand_loss(cliprange_high=0.28)
    # ratio 0.7, A < 0: clipped up to 0.8; 1.1: inside; 1.25: inside [0.8, 1.28] (clipped at 1.2 symmetrically);
    # 1.4, A > 0: clipped to 1.28; 1.4, A < 0: the unclipped loss is the larger, no clip acts
    torch.testing.assert_close(losses, torch.tensor([0.8, -1.1, -1.25, -1.28, 1.4]))
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)
    assert stats["policy/clipfrac_avg"].item() == pytest.approx(2 / 5)
    symmetric, stats = hand_loss()
    torch.testing.assert_close(symmetric, torch.tensor([0.8, -1.1, -1.2, -1.2, 1.4]))
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(2 / 5)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(3 / 5)
    same, _ = hand_loss(cliprange_high=0.2)
    assert torch.equal(same, symmetric)


def test_mismatch_clipfrac_uses_the_losss_clip_range():
    ratios = torch.tensor([0.85, 1.25])  # inside [0.8, 1.28]; 1.25 outside the symmetric [0.8, 1.2]
    mask = torch.ones(2, 1, dtype=torch.bool)
    rollout = rloo.Rollout(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                           torch.ones(2, 1, dtype=torch.long), mask, ratios.log()[:, None], None,
                           sampler_logprobs=torch.zeros(2, 1))
    for high, expected in ((0.2, 0.5), (0.28, 0.0)):
        args = rloo.Args(cliprange=0.2, epsilon_high=high)
        metrics = plumbing.mismatch_metrics(rollout, args.cliprange, args.cliprange_high)
        assert metrics["mismatch/clipfrac"] == expected


# ---------------------------------------------------------------- --mask_truncated_completions, by hand
def test_masked_completions_have_no_loss_no_gradient_and_leave_the_statistics():
    in_loss = torch.tensor([True, True, False, True, False])  # completions 2 and 4 did not stop
    new = torch.tensor(RATIOS).log()[:, None].requires_grad_()
    entropy = torch.tensor([[1.0], [2.0], [30.0], [4.0], [50.0]])
    losses, stats = policy_loss_of(new, torch.zeros(5, 1), torch.tensor(ADVANTAGES),
                                     torch.ones(5, 1, dtype=torch.bool), 0.2, per_token=False, entropy=entropy,
                                     epsilon_high=0.28, in_loss=in_loss)
    torch.testing.assert_close(losses.detach(), torch.tensor([0.8, -1.1, 0.0, -1.28, 0.0]))
    losses.sum().backward()
    assert new.grad[2].item() == 0 and new.grad[4].item() == 0 and new.grad[1].item() != 0
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)  # over the 3 kept completions
    assert stats["entropy"].item() == pytest.approx((1 + 2 + 4) / 3)
    # per-token actions: the masked completions' tokens weigh 0 too
    token_losses, _ = policy_loss_of(new.detach(), torch.zeros(5, 1), torch.tensor(ADVANTAGES),
                                       torch.ones(5, 1, dtype=torch.bool), 0.2, per_token=True, in_loss=in_loss)
    assert token_losses[2].item() == 0 and token_losses[4].item() == 0 and token_losses[0].item() != 0


def test_mask_truncated_keeps_the_normalizer_and_the_baselines_as_trl_does():
    """TRL's sequence loss is a mean over every completion of the batch, a masked one counting as 0, and a masked
    completion's reward stays in its group's baselines without its KL (TRL 1.16 zeroes its completion mask): so the
    normalizer counts every completion, a masked completion's reward is its score, the others' are the plain run's,
    and without a KL penalty the advantages are the plain run's (tests/trl116_same_batch.py: against TRL's code)."""
    policy, history = train(2, mask=True)
    rollout, stats, values = history[1]  # the second update's: the policy has moved from its reference
    masked = ~rollout.in_loss
    assert masked.any() and not masked.all()
    assert stats["completions/masked_truncated"] == float(masked.sum())
    kl = ((rollout.logprobs - rollout.ref_logprobs) * rollout.response_mask).sum(1)  # (k*B,)
    assert values.non_score_reward[masked].abs().sum() == 0 and kl[masked].abs().sum() > 0
    torch.testing.assert_close(values.non_score_reward[~masked], -0.1 * kl[~masked])
    (_, _, without_kl), = train(1, mask=True, kl_coef=0.0)[1]
    (_, _, plain_without_kl), = train(1, kl_coef=0.0)[1]
    torch.testing.assert_close(without_kl.advantages, plain_without_kl.advantages, rtol=0, atol=0)


# ---------------------------------------------------------------- training: neutral settings, active settings
K, PROMPTS, UPDATES = 4, 4, 3


def train(updates: int = UPDATES, mask: bool = False, in_loss_all: bool = False, kl_coef: float = 0.1, **flags):
    """`updates` updates of the tiny policy (its reference a copy) on 4 prompts x 4 completions, 2 epochs x 2
    minibatches, with rloo.py's functions as main calls them. Returns the policy and each update's (rollout, stats)."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer), seed=0)
    ref_policy = tiny_policy(len(tokenizer), seed=0).requires_grad_(False)
    reward_model = tiny_reward_model(len(tokenizer))
    args = rloo.Args(**{"rloo_k": K, "per_device_train_batch_size": K, "num_ppo_epochs": 2, "num_mini_batches": 2,
                        "gradient_accumulation_steps": 2, "temperature": 1.0, "response_length": 4,
                        "kl_coef": kl_coef, "mask_truncated_completions": mask,
                        "local_rollout_forward_batch_size": K * PROMPTS} | flags)
    sizes = rloo.compute_batch_sizes(args, 1)
    optimizer = torch.optim.SGD(policy.parameters(), lr=2.0)
    generator = torch.Generator().manual_seed(0)
    rows = prompt_rows(PROMPTS * updates, seed=3)
    steps_per_update = args.num_ppo_epochs * args.num_mini_batches
    history = []
    for update in range(updates):
        queries, query_mask = left_padded(tokenizer, [r["prompt"] for r in rows[update * PROMPTS:][:PROMPTS]])
        c = rloo.sample_completions(policy, queries, query_mask, args.response_length, 1.0, 1, 0, generator, k=K)
        rollout = rloo.collect_rollout(policy, ref_policy, c, args, True, False, NO_AUTOCAST, plumbing.PhaseTimer(CPU))
        has_stop = rollout.ended(1)
        rollout.in_loss = has_stop if args.mask_truncated_completions else \
            torch.ones_like(has_stop) if in_loss_all else None
        scores = 10 * rloo.reward_model_scores(reward_model, c, True)  # (k*B,)
        torch.manual_seed(update)
        stats, values = rloo.ppo_update(policy, optimizer, rollout, scores, args, sizes, True, NO_AUTOCAST,
                                        ref_policy, update * steps_per_update)
        history.append((rollout, stats, values))
    train.ref_policy = ref_policy
    return policy, history


def weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.parameters()]


@pytest.fixture(scope="module")
def plain():
    policy, history = train()
    return weights(policy), history


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("neutral", [{"epsilon_high": 0.2}, {"in_loss_all": True},
                                     {"sync_ref_model": True, "ref_model_mixup_alpha": 0.0, "ref_model_sync_steps": 1},
                                     {"sync_ref_model": True, "ref_model_sync_steps": 1000}],
                         ids=["epsilon_high=cliprange", "every-completion-in-loss", "mixup_alpha=0",
                              "sync_steps-past-the-run"])
def test_the_neutral_setting_gives_bit_identical_weights(plain, neutral):
    policy, _ = train(**neutral)
    assert same(weights(policy), plain[0])


@pytest.mark.parametrize("active", [{"epsilon_high": 5.0}, {"mask": True},
                                    {"sync_ref_model": True, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 2}],
                         ids=["epsilon_high", "mask_truncated_completions", "sync_ref_model"])
def test_the_active_setting_changes_training(plain, active):
    policy, history = train(**active)
    assert not same(weights(policy), plain[0])
    if "epsilon_high" in active:  # the clip acted in the plain run above 1 + cliprange, and not here
        assert any(s["clip_ratio/high_mean"] > 0 for _, s, _ in plain[1])
        assert all(s["clip_ratio/high_mean"] == 0 for _, s, _ in history)


def test_trdpo_mixes_the_reference_every_sync_steps_optimizer_steps(monkeypatch):
    """After each optimizer step whose count over the run is a multiple of ref_model_sync_steps:
    ref <- alpha * policy + (1 - alpha) * ref, by hand."""
    mixes = []
    mix = rloo.sync_reference

    def recorded(ref_policy, policy, alpha):
        before = weights(ref_policy)
        mix(ref_policy, policy, alpha)
        for r, p, b in zip(ref_policy.parameters(), policy.parameters(), before):
            torch.testing.assert_close(r, alpha * p.detach() + (1 - alpha) * b, rtol=0, atol=1e-7)
        mixes.append(weights(ref_policy))

    monkeypatch.setattr(rloo, "sync_reference", recorded)
    policy, _ = train(2, sync_ref_model=True, ref_model_mixup_alpha=0.6, ref_model_sync_steps=3)
    assert len(mixes) == 2  # 8 optimizer steps: after steps 3 and 6
    assert same(weights(train.ref_policy), mixes[-1])
    tokenizer = policy_tokenizer()
    ref, pol = tiny_policy(len(tokenizer)), tiny_policy(len(tokenizer), seed=1)
    expected = [0.25 * p + 0.75 * r for p, r in zip(weights(pol), weights(ref))]
    mix(ref, pol, 0.25)
    assert same(weights(ref), expected)  # in fp32: exactly the formula


def test_non_score_reward_is_what_the_estimator_added_to_the_score(plain):
    rollout, _, values = plain[1][-1]  # the first update's policy is its reference
    kl = (rollout.logprobs - rollout.ref_logprobs) * rollout.response_mask
    torch.testing.assert_close(values.non_score_reward, -0.1 * kl.sum(1), rtol=0, atol=1e-6)
    assert values.non_score_reward.abs().sum() > 0


def test_warmup_ratio_rises_then_decays():
    """TRL <= 0.21's arithmetic: one rate per update (every optimizer step of an update at it), the warmup from
    learning_rate / warmup updates; --warmup_steps as transformers 5 takes it (>= 1 steps, below 1 a share)."""
    def rates(updates, steps_per_update=1, **flags):
        rate = plumbing.learning_rates(rloo.Args(learning_rate=1.0, **flags), plumbing.RunLength(updates,
                                                                                                 steps_per_update))
        return [rate(s) for s in range(1, updates * steps_per_update + 1)]

    assert rates(8, warmup_ratio=0.25) == pytest.approx([0.5, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])
    assert rates(8, warmup_steps=2) == rates(8, warmup_steps=0.25) == rates(8, warmup_ratio=0.25)
    assert rates(8) == [1.0 - (u - 1) / 8 for u in range(1, 9)]
    assert rates(4, 3) == [r for r in rates(4) for _ in range(3)]  # once per update, whatever its steps
    assert rates(4, warmup_ratio=0.5, lr_scheduler_type="cosine") == pytest.approx([0.5, 1.0, 1.0, 0.5])
    assert rates(4, warmup_ratio=0.5, lr_scheduler_type="constant_with_warmup") == pytest.approx([0.5, 1.0, 1.0, 1.0])


# ---------------------------------------------------------------- whole runs: resume, TRL's command
RUN = ("--reward_fn", "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "8",
       "--gradient_accumulation_steps", "2", "--num_mini_batches", "2", "--num_ppo_epochs", "2",
       "--response_length", "6", "--temperature", "1.0", "--max_prompt_length", "16",
       "--local_rollout_forward_batch_size", "32", "--learning_rate", "3e-2", "--num_sample_generations", "0",
       "--num_evals", "0", "--save_steps", "2", "--kl_coef", "0.2", "--stop_token_id", "1")


@pytest.mark.parametrize("option", [("--epsilon_high", "0.5"), ("--mask_truncated_completions",),
                                    ("--sync_ref_model", "--ref_model_sync_steps", "3", "--ref_model_mixup_alpha",
                                     "0.5"),
                                    ("--max_steps", "16", "--warmup_ratio", "0.5", "--save_steps", "8"),  # steps
                                    ("--kl_in_loss",)],
                         ids=["epsilon_high", "mask_truncated_completions", "sync_ref_model", "max_steps-warmup",
                              "kl_in_loss"])
def test_resume_is_bit_identical_with_each_option(assets, tmp_path, option):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *RUN, *option]
    length = [] if "--max_steps" in option else ["--total_episodes", "128"]  # 4 updates of 32 completions
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    result = run_rloo(*common, *length, "--output_dir", full)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(full)
    assert len(metrics) == 4
    result = run_rloo(*common, *length, "--output_dir", resumed, "--resume_from", full / "checkpoints" / "step_2")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if "--mask_truncated_completions" in option:
        assert sum(m["completions/masked_truncated"] for m in metrics) > 0
    if "--sync_ref_model" in option:  # the mixed reference is in the checkpoint: the KL after a resume is the same
        assert [m["objective/kl"] for m in read_metrics(resumed)] == [m["objective/kl"] for m in metrics[2:]]
    if "--warmup_ratio" in option:
        assert [m["lr"] for m in metrics] == pytest.approx([1.5e-2, 3e-2, 3e-2, 1.5e-2])


def test_a_trl_rloo_command_with_local_paths_runs(assets, tmp_path):
    """TRL 1.16's docs' flags (the `trl rloo` script's, RLOOConfig's, the Trainer's), the models and data local."""
    result = run_rloo(
        "--model_name_or_path", assets["policy"], "--reward_model_name_or_path", assets["reward_model"],
        "--reward_funcs", "reward_fns.count_a", "--dataset_name", assets["train"], "--output_dir", tmp_path / "out",
        "--num_generations", "4", "--max_completion_length", "6", "--learning_rate", "1e-3",
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--steps_per_generation", "1",
        "--num_iterations", "1", "--beta", "0.05", "--epsilon", "0.2", "--epsilon_high", "0.28",
        "--mask_truncated_completions", "True", "--sync_ref_model", "True", "--ref_model_sync_steps", "2",
        "--ref_model_mixup_alpha", "0.6", "--normalize_advantages", "False", "--temperature", "1.0",
        "--bf16", "False", "--gradient_checkpointing", "True", "--logging_steps", "2", "--report_to", "none",
        "--save_strategy", "no", "--max_steps", "3", "--warmup_ratio", "0.1", "--lr_scheduler_type", "linear",
        "--dtype", "float32", "--attn_implementation", "sdpa", "--disable_dropout", "True", "--seed", "42",
        "--max_prompt_length", "16", "--num_evals", "0", "--num_sample_generations", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "out")
    assert len(metrics) == 3
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "entropy", "reward",
                "reward_std", "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/mean_terminated_length", "completions/clipped_ratio", "frac_reward_zero_std",
                "reward/reward_model/std", "completions/masked_truncated", "objective/non_score_reward"):
        assert key in metrics[0], key
    assert sum(key.startswith("reward/") and key.endswith("/std") for key in metrics[0]) == 2  # each source's
    assert result.stdout.count("cannot act") == 1  # on-policy: the clip range is inert, said once
    assert sum(line.startswith("update ") for line in result.stdout.splitlines()) == 2  # updates 2 and 3 (the last)
    assert math.isclose(metrics[0]["clip_ratio/region_mean"], 0.0)


@pytest.mark.parametrize("kind", ["use_rslora", "use_dora"])
def test_rslora_and_dora_adapters_train_and_their_reference_is_the_base(kind):
    """peft's rank-stabilized scaling and DoRA's magnitudes; switched off, the policy is its base exactly."""
    tokenizer = policy_tokenizer()
    base, policy = tiny_policy(len(tokenizer)), tiny_policy(len(tokenizer))
    args = rloo.Args(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=("all-linear",), **{kind: True})
    assert getattr(plumbing.lora_config(args), kind) is True
    plumbing.add_adapters(policy, args, None)
    layer = plumbing.peft_layers(policy)[0]
    assert layer.scaling["default"] == (8 / 2 if kind == "use_rslora" else 8 / 4)  # alpha / sqrt(r), or alpha / r
    assert bool(layer.lora_magnitude_vector) == (kind == "use_dora")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()  # adapters that change the output
    ids = torch.tensor([[2, 3, 4, 5]])
    reference = plumbing.AdaptersOff(policy)
    assert not torch.allclose(policy(ids).logits, base(ids).logits)
    torch.testing.assert_close(reference(ids).logits, base(ids).logits)
