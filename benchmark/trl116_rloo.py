"""TRL 1.16's RLOOTrainer (the current one: a GRPO-style `Trainer` subclass) driven by rloo.py's own command line, for
side-by-side benchmarks, as benchmark/trl_rloo.py drives TRL 0.21's.

    PYTHONPATH=benchmark/.trl116-site python benchmark/trl116_rloo.py --model_name_or_path ... [rloo.py flags]
    ... benchmark/trl116_rloo.py ... --use_vllm     # TRL's colocated vLLM engine (vllm_mode="colocate")

It runs in the project's own environment (transformers 5.x) with TRL 1.16 put first on PYTHONPATH (`make bench-env`
installs it, without its dependencies, into benchmark/.trl116-site; `make bench-gpu` from the wheel folder). The flags
are parsed by rloo.py's `Args`; the tokenizer, policy, reward model and prompts are loaded by rloo.py's own loaders, so
both trainers start from the same weights and the same prompt token ids (TRL's own tokenization of the prompt text is
replaced by those ids). The reference is built by TRL (from the policy's path, bf16 under --bf16, as rloo.py's). The
reward model is handed to TRL as TRL users hand it: TRL decodes prompt and completion to text and tokenizes them
again with the reward model's tokenizer. rloo.py's settings map to TRL 1.16's names: rloo_k -> num_generations,
kl_coef -> beta, cliprange -> epsilon, response_length -> max_completion_length, num_ppo_epochs -> num_iterations,
gradient_accumulation_steps x num_mini_batches -> steps_per_generation (micro-batches per generation),
reward_clip_range R -> (-R, R); an update (one generation and its num_ppo_epochs x num_mini_batches optimizer steps)
is one metrics row. TRL 1.16 has no chunk size of its own: it samples the update's completions in one `generate`
call and computes log-probs in chunks of the micro-batch, so --local_rollout_forward_batch_size must equal
--per_device_train_batch_size (rloo.py's chunk then matches TRL's log-prob chunks, not its sampling batch).
`--stop_token None` (every completion response_length tokens) becomes a minimum length of response_length, as TRL
always stops at the tokenizer's EOS.

Written to `--output_dir`: `metrics.jsonl` (TRL 1.16's logged metrics, `objective/scores` (TRL's `reward`: no EOS
penalty or normalization here), `episode`, `completions/mean_length`, and rloo.py's `time/*`, `work/*` and, on CUDA,
`memory/*`), and the final policy and tokenizer. Phases: `time/generation` (TRL's `_generate`: sampling, with
transformers or the vLLM engine), `time/weight_sync` (with --use_vllm: the policy's weights loaded into the colocated
engine, in-process; left out of generation), `time/policy_forward` (TRL's no-grad pass for the old log-probs, which
it runs even on-policy), `time/reference_forward`, `time/scoring` (the reward model), `time/training` (the rest);
on CUDA `memory/<phase>_gib`, training's from the end of the last phase to the end of the update.
Flags with no TRL 1.16 equivalent are refused in one line.
"""

import copy
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import plumbing  # noqa: E402
import rloo  # noqa: E402

TRL_VERSION = "1.16.0"
SAME_NAMES = ("seed", "learning_rate", "adam_epsilon", "max_grad_norm", "lr_scheduler_type",
              "per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "bf16",
              "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "epsilon_high",
              "mask_truncated_completions", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
              "trust_remote_code", "weight_decay")  # rloo.py flags RLOOConfig has under the same name and meaning
HONOURED = SAME_NAMES + (  # mapped to TRL's names (trl_config), or read by rloo.py's loaders this driver calls
    "model_name_or_path", "sft_model_path", "reward_model_path", "pad_token", "dataset_name", "dataset_config",
    "dataset_train_split", "prompt_column", "max_prompt_length", "exp_name", "run_name", "output_dir", "rloo_k",
    "kl_coef", "cliprange", "normalize_advantage", "reward_clip_range", "response_length", "stop_token",
    "total_episodes", "max_steps", "num_train_epochs", "num_mini_batches", "num_ppo_epochs", "warmup_ratio",
    "local_rollout_forward_batch_size")
NO_EFFECT = (  # rloo.py's logging, evaluation and saving choices (this driver logs each update and saves the final
    # policy only), and settings that act only with a flag refused here (--fsdp, --use_peft, the IS correction)
    "num_sample_generations", "logging_steps", "num_evals", "eval_max_prompts", "save_strategy", "save_total_limit",
    "overwrite_output_dir", "allow_changed_inputs", "ddp_timeout", "reward_fn_timeout", "wandb_project_name",
    "wandb_entity", "log_completions", "num_completions_to_print", "num_generations_eval", "fsdp_generation",
    "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save", "use_rslora", "use_dora",
    "merge_lora", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap")


def check_supported(args: rloo.Args) -> None:
    default = rloo.Args()  # any other flag away from its default (rloo.py's flags to come included) is refused
    changed = [f"--{f.name}" for f in fields(rloo.Args) if f.name not in HONOURED + NO_EFFECT
               and getattr(args, f.name) != getattr(default, f.name)]
    if changed:
        raise plumbing.ConfigError(f"TRL 1.16's RLOOTrainer, as benchmark/trl116_rloo.py drives it, has no "
                                   f"equivalent of {', '.join(changed)}: drop them")
    if args.reward_model_path is None:
        raise plumbing.ConfigError("benchmark/trl116_rloo.py scores with a reward model: pass --reward_model_path")
    if args.local_rollout_forward_batch_size != args.per_device_train_batch_size:
        raise plumbing.ConfigError(
            f"TRL 1.16 computes log-probs in chunks of per_device_train_batch_size ({args.per_device_train_batch_size})"
            f" and samples a whole update's completions in one call: pass --local_rollout_forward_batch_size "
            f"{args.per_device_train_batch_size} (to both trainers) rather than "
            f"{args.local_rollout_forward_batch_size}")


def updates_of(args: rloo.Args, batch: int, num_prompts: int) -> int:
    """rloo.py's updates: --max_steps optimizer steps, else --total_episodes completions, else num_train_epochs over
    the prompts, k completions each."""
    if args.max_steps is not None:
        return args.max_steps // (args.num_ppo_epochs * args.num_mini_batches)
    episodes = args.total_episodes or int(args.num_train_epochs * num_prompts * args.rloo_k)
    return max(1, episodes // batch)


def trl_config(args: rloo.Args, updates: int, use_cpu: bool, use_vllm: bool):
    from trl import RLOOConfig

    steps_per_update = args.num_ppo_epochs * args.num_mini_batches
    full_length = {"min_tokens" if use_vllm else "min_new_tokens": args.response_length}  # vLLM's name, transformers'
    return RLOOConfig(
        output_dir=args.output_dir, run_name=args.run_name or args.exp_name, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, use_cpu=use_cpu, shuffle_dataset=True,
        **{name: getattr(args, name) for name in SAME_NAMES},
        model_init_kwargs={"dtype": torch.bfloat16} if args.bf16 else None,  # the reference's: bf16 as rloo.py's
        num_generations=args.rloo_k, beta=args.kl_coef, epsilon=args.cliprange,
        normalize_advantages=args.normalize_advantage,
        reward_clip_range=(-args.reward_clip_range, args.reward_clip_range) if args.reward_clip_range else None,
        max_completion_length=args.response_length, num_iterations=args.num_ppo_epochs,
        steps_per_generation=args.gradient_accumulation_steps * args.num_mini_batches,
        generation_kwargs=None if args.stop_token else full_length, max_steps=updates * steps_per_update,
        warmup_steps=args.warmup_ratio,  # transformers 5: a float < 1 is a ratio
        use_vllm=use_vllm, vllm_mode="colocate",
    )


def instrument(trainer, device: torch.device, output_dir: Path, k: int, num_ppo_epochs: int, steps_per_update: int,
               batch: int):
    """Time TRL's phases by wrapping the trainer's own methods, count the tokens its models' forward passes take (the
    rest of the update is `training`), and write one metrics.jsonl row per update (one generation and its optimizer
    steps). Returns the callback that writes them."""
    from transformers import TrainerCallback

    timer = plumbing.PhaseTimer(device, default_phase="training")
    reward_models = [f for f in trainer.reward_funcs if isinstance(f, torch.nn.Module)]
    timer.count_tokens_of(trainer.model, trainer.ref_model, *reward_models)
    fresh = {"prompt_tokens": 0.0, "response_tokens": 0, "responses": 0, "weight_sync": 0.0}  # per update
    state = {"logs": {}, "mark": None, "row": None, **fresh}

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def wrap(name: str, phase_of):
        original = getattr(trainer, name)

        def wrapper(*a, **kw):
            phase = phase_of(*a, **kw)
            if phase is None:
                return original(*a, **kw)
            with timer(phase):
                out = original(*a, **kw)
            if device.type == "cuda":  # what follows the last phase is training: its peak from here
                torch.cuda.reset_peak_memory_stats(device)
            if name == "_generate":  # (prompt ids, completion ids, texts): each prompt repeated k times
                prompt_ids, completion_ids = out[0], out[1]
                state["prompt_tokens"] += sum(len(ids) for ids in prompt_ids) / k
                state["response_tokens"] += sum(len(ids) for ids in completion_ids)
                state["responses"] += len(completion_ids)
            return out
        setattr(trainer, name, wrapper)

    def logps_phase(model, *a, **kw):
        if torch.is_grad_enabled():  # the training passes
            return None
        return "reference_forward" if model is trainer.ref_model else "policy_forward"

    wrap("_generate", lambda *a, **kw: "generation")
    wrap("_get_per_token_logps_and_entropies", logps_phase)
    wrap("_calculate_rewards", lambda *a, **kw: "scoring")
    if trainer.use_vllm:  # inside _generate: timed on its own and taken out of generation
        engine, load = trainer.vllm_generation, trainer.vllm_generation.sync_weights

        def timed_sync():
            start = sync()
            load()
            state["weight_sync"] += sync() - start
        engine.sync_weights = timed_sync
    metrics_file = open(output_dir / "metrics.jsonl", "w")

    class Recorder(TrainerCallback):
        def on_train_begin(self, *_, **__):
            state["mark"] = sync()

        def on_step_end(self, _args, trainer_state, _control, **__):
            if trainer_state.global_step % steps_per_update:
                return
            seconds = sync() - state["mark"]
            update = trainer_state.global_step // steps_per_update
            row = {"update": update, "episode": update * batch, **timer.metrics(), "time/update": seconds}
            if trainer.use_vllm:
                row["time/weight_sync"] = state["weight_sync"]
                row["time/generation"] -= state["weight_sync"]
            row["time/training"] = seconds - sum(timer.seconds.values()) - state["weight_sync"]
            row["completions/mean_length"] = state["response_tokens"] / state["responses"]
            row["work/minimum_tokens"] = (state["prompt_tokens"] + state["response_tokens"]) * sum(
                num_ppo_epochs if phase == "training" else 1 for phase in timer.tokens)
            if device.type == "cuda":
                row["memory/training_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                row["memory/peak_gib"] = max(row.get("memory/peak_gib", 0.0), row["memory/training_gib"])
            state["row"] = row  # written by on_log, which the Trainer calls next with this step's metrics

        def on_log(self, _args, _state, _control, logs=None, **__):
            state["logs"].update({key: value for key, value in (logs or {}).items() if key != "epoch"})
            row = state["row"]
            if row is None:
                return
            row = {**state["logs"], **row, "objective/scores": state["logs"].get("reward", float("nan"))}
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            print(f"trl 1.16 update {row['update']} episode {row['episode']} | score {row['objective/scores']:.4g} | "
                  f"update {row['time/update']:.2f}s", flush=True)
            timer.start_update()
            state.update(logs={}, row=None, **copy.deepcopy(fresh))
            state["mark"] = sync()

    return Recorder()


def main(args: rloo.Args) -> None:
    use_vllm = "--use_vllm" in sys.argv[1:]
    check_supported(args)  # before TRL's imports: a refused flag costs no TRL start-up
    sizes = rloo.compute_batch_sizes(args, world_size=1)  # the same clash errors as rloo.py
    try:
        import trl
    except ImportError as e:
        raise plumbing.ConfigError(f"benchmark/trl116_rloo.py drives TRL {TRL_VERSION}, which this Python cannot "
                                   f"import ({plumbing.first_line(e)}): run `make bench-env` and put "
                                   "benchmark/.trl116-site first on PYTHONPATH")
    if trl.__version__ != TRL_VERSION:
        raise plumbing.ConfigError(f"benchmark/trl116_rloo.py drives TRL {TRL_VERSION}; this Python imports TRL "
                                   f"{trl.__version__} from {Path(trl.__file__).parent}: put benchmark/.trl116-site "
                                   "(make bench-env) first on PYTHONPATH")
    import transformers
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import RLOOTrainer

    plumbing.check_new_output_dir(args.output_dir, plumbing.run_inputs(args))  # nothing there written over
    transformers.set_seed(args.seed)
    plumbing.quiet_hub_progress_bars()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy, ref_policy, tokenizer, stop_token_id = rloo.load_policy(args, torch.device("cpu"))
    del ref_policy  # TRL builds its own, from the policy's path
    if stop_token_id is not None and stop_token_id != tokenizer.eos_token_id:
        raise plumbing.ConfigError(f"TRL 1.16 stops at the tokenizer's EOS ({tokenizer.eos_token_id}); rloo.py would "
                                   f"stop at {stop_token_id}: give the tokenizer that EOS, or pass --stop_token None")
    reward_model = plumbing.load_reward_model(args.reward_model_path, torch.bfloat16 if args.bf16 else torch.float32,
                                              args.trust_remote_code)
    dataset, _, _ = plumbing.load_prompts(args, tokenizer, None, plumbing.prompt_token_ids)
    prompt_ids = [list(ids) for ids in dataset[plumbing.PROMPT_IDS]]
    texts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    ids_of = dict(zip(texts, prompt_ids))  # TRL tokenizes the text; it gets rloo.py's ids for it instead
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    updates = updates_of(args, sizes.local, len(prompt_ids))
    trainer = RLOOTrainer(
        model=policy, reward_funcs=reward_model, args=trl_config(args, updates, device.type == "cpu", use_vllm),
        train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tokenizer,
        reward_processing_classes=plumbing.load_tokenizer(args.reward_model_path, args.trust_remote_code))
    trainer._tokenize_prompts = lambda prompts: ([ids_of[p] for p in prompts], None, {})
    steps_per_update = args.num_ppo_epochs * args.num_mini_batches
    trainer.add_callback(instrument(trainer, device, output_dir, args.rloo_k, args.num_ppo_epochs, steps_per_update,
                                    sizes.local))
    trainer.remove_callback(PrinterCallback)  # it prints every metrics dict; the Recorder prints a line
    trainer.train()
    trainer.accelerator.unwrap_model(trainer.model).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if a != "--use_vllm"]  # this driver's one flag of its own
    plumbing.run_script(main, plumbing.parse_args(rloo.Args, argv, prog="trl116_rloo.py"), "trl116_rloo.py")
