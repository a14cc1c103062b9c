"""TRL's RLOOTrainer (trl 0.21, the last release of the trainer whose flags rloo.py keeps) driven by rloo.py's own
command line, for side-by-side benchmarks.

    benchmark/.venv-trl/bin/python benchmark/trl_rloo.py --model_name_or_path ... [any rloo.py flags]

It runs in the benchmark environment (`make bench-env`: benchmark/requirements.txt, with transformers 4.x, which
trl 0.21 needs). The flags are parsed by rloo.py's `Args`, and the tokenizer, policy, reference, reward model and
prompts are loaded by rloo.py's own loaders, so both trainers start from the same weights and the same tokenized
prompts. Written to `--output_dir`: `metrics.jsonl` with rloo.py's metric names (TRL's metrics plus `time/*` and,
on CUDA, `memory/peak_gib`), and the final policy and tokenizer.

Reward functions (`--reward_fn`) are allowed as monitors only, with weight 0 (`--reward_weights 1 0`): logged as
`reward/<name>/mean` on the decoded prompts and completions, as rloo.py logs them, never part of the reward.

Phase times: `time/generation` (TRL's batch_generation: sampling, and the log-probs it keeps from the sampling
logits), `time/reference_forward`, `time/scoring` (the reward model), and `time/training`, the rest of the update
(mostly the PPO epochs). Flags TRL 0.21 has no equivalent for are refused, and `--max_grad_norm` must be 0: TRL 0.21
never clips gradients (so an A/B run passes `--max_grad_norm 0` to rloo.py as well).
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

import plumbing
import rloo  # noqa: E402

# rloo.py flags whose non-default values TRL 0.21's trainer cannot reproduce
UNSUPPORTED = ("save_steps", "resume", "resume_from", "track",
               "dataset_test_split", "lr_scheduler_type")


def check_supported(args: rloo.Args) -> None:
    default = rloo.Args()
    changed = [f"--{f.name}" for f in fields(rloo.Args)
               if f.name in UNSUPPORTED and getattr(args, f.name) != getattr(default, f.name)]
    if changed:
        raise plumbing.ConfigError(f"TRL 0.21's RLOOTrainer has no equivalent of {', '.join(changed)}: drop them")
    if args.max_grad_norm != 0:
        raise plumbing.ConfigError("TRL 0.21's RLOOTrainer never clips gradients: pass --max_grad_norm 0 (to both)")
    if args.reward_model_path is None:
        raise plumbing.ConfigError("TRL 0.21's RLOOTrainer needs a reward model: pass --reward_model_path")
    if args.reward_fn and tuple(args.reward_weights or ()) != (1.0,) + (0.0,) * len(args.reward_fn):
        raise plumbing.ConfigError("TRL 0.21's RLOOTrainer scores with the reward model alone: --reward_fn can only be "
                               "monitored, with --reward_weights 1 0 ... (the reward model 1, each function 0)")


def trl_config(args: rloo.Args, use_cpu: bool):
    from trl import RLOOConfig

    return RLOOConfig(
        output_dir=args.output_dir, exp_name=args.exp_name, seed=args.seed, report_to="none", save_strategy="no",
        logging_steps=1, num_sample_generations=0, disable_tqdm=True, use_cpu=use_cpu, bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        rloo_k=args.rloo_k, kl_coef=args.kl_coef, token_level_kl=args.token_level_kl,
        missing_eos_penalty=args.missing_eos_penalty, normalize_reward=args.normalize_reward,
        reward_clip_range=args.reward_clip_range, normalize_advantage=args.normalize_advantage,
        cliprange=args.cliprange, response_length=args.response_length, temperature=args.temperature,
        stop_token=args.stop_token, stop_token_id=args.stop_token_id,
        local_rollout_forward_batch_size=args.local_rollout_forward_batch_size,
        total_episodes=args.total_episodes, num_train_epochs=args.num_train_epochs * args.rloo_k,  # TRL 0.21's
        # epoch is the prompts once (rloo.py's, TRL 1.16's: each prompt k times)
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, num_mini_batches=args.num_mini_batches,
        num_ppo_epochs=args.num_ppo_epochs, learning_rate=args.learning_rate, adam_epsilon=args.adam_epsilon,
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=args.weight_decay,
    )


def decode_for_monitors(tokenizer, query_responses: torch.Tensor, context_length: int, stop_token_id) -> dict:
    """What rloo.py hands reward functions, from TRL's (N, Tq + Tr) left-padded, truncated sequences: the prompt
    texts, the completion texts without the stop token, and the completion ids with it."""
    prompts = tokenizer.batch_decode([q[q != tokenizer.pad_token_id].tolist()
                                      for q in query_responses[:, :context_length]], skip_special_tokens=True)
    completion_ids = []
    for response in query_responses[:, context_length:].tolist():
        ids = response[: response.index(stop_token_id) + 1] if stop_token_id in response else response
        completion_ids.append([t for t in ids if t != tokenizer.pad_token_id])
    without_stop = [ids[:-1] if ids and ids[-1] == stop_token_id else ids for ids in completion_ids]
    return {"prompts": prompts, "completions": tokenizer.batch_decode(without_stop, skip_special_tokens=True),
            "completion_ids": completion_ids}


def instrument(trainer_module, device: torch.device, output_dir: Path, monitors, tokenizer, stop_token_id, models,
               k: int, num_ppo_epochs: int):
    """Time TRL's phases by wrapping the functions its update calls, count the tokens its models' forward passes
    take (as rloo.py counts its own: the rest of the update is `training`), evaluate the monitored reward functions
    on what the reward model scores, and write one metrics.jsonl row per update from a callback. Returns the
    callback."""
    from transformers import TrainerCallback

    timer = plumbing.PhaseTimer(device, default_phase="training")
    timer.count_tokens_of(*models)
    fresh = {"monitored": {}, "prompt_tokens": 0.0, "response_tokens": 0, "responses": 0}  # per update
    state = {"logs": {}, "mark": None, **fresh}

    def get_reward_and_monitor(model, query_responses, pad_token_id, context_length):
        with timer("scoring"):  # the monitors too, as in rloo.py, where weight 0 costs the same
            real = query_responses != pad_token_id  # (chunk, Tq + Tr): TRL pads after the stop token
            # unpadded, summed over the update's chunks: each prompt once (TRL's rows repeat it k times), each response
            state["prompt_tokens"] += int(real[:, :context_length].sum()) / k
            state["response_tokens"] += int(real[:, context_length:].sum())
            state["responses"] += real.shape[0]
            out = get_reward(model, query_responses, pad_token_id, context_length)
            if monitors:
                texts = decode_for_monitors(tokenizer, query_responses, context_length, stop_token_id)
                for name, fn in monitors:
                    values, applies = plumbing.call_reward_function(name, fn, query_responses.shape[0], **texts)
                    state["monitored"].setdefault(name, []).extend(values[applies].tolist())
        return out

    def timed(phase: str, fn, only_without_grad: bool = False):
        def wrapper(*a, **kw):
            if only_without_grad and torch.is_grad_enabled():  # forward() also runs the training passes
                return fn(*a, **kw)
            with timer(phase):
                return fn(*a, **kw)
        return wrapper

    trainer_module.batch_generation = timed("generation", trainer_module.batch_generation)
    trainer_module.forward = timed("reference_forward", trainer_module.forward, only_without_grad=True)
    get_reward = trainer_module.get_reward
    trainer_module.get_reward = get_reward_and_monitor
    metrics_file = open(output_dir / "metrics.jsonl", "w")

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    class Recorder(TrainerCallback):
        def on_train_begin(self, *_, **__):
            state["mark"] = now()

        def on_log(self, _args, _state, _control, logs=None, **__):
            state["logs"] = dict(logs or {})

        def on_step_end(self, _args, trainer_state, _control, **__):
            end = now()
            seconds = end - state["mark"]
            row = {"update": trainer_state.global_step, **state["logs"], **timer.metrics(), "time/update": seconds}
            row["time/training"] = seconds - sum(timer.seconds.values())
            row["completions/mean_length"] = state["response_tokens"] / state["responses"]  # TRL 0.21 does not log it
            row["work/minimum_tokens"] = (state["prompt_tokens"] + state["response_tokens"]) * sum(
                num_ppo_epochs if phase == "training" else 1 for phase in timer.tokens)
            row.update({f"reward/{name}/mean": sum(v) / len(v) for name, v in state["monitored"].items() if v})
            if device.type == "cuda":  # the peak since the last phase began covers the PPO epochs
                row["memory/peak_gib"] = max(row.get("memory/peak_gib", 0.0),
                                             torch.cuda.max_memory_allocated(device) / 2**30)
            row.pop("epoch", None)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            print(f"trl update {row['update']} episode {row.get('episode')} | score "
                  f"{row.get('objective/scores', float('nan')):.4g} | update {seconds:.2f}s", flush=True)
            timer.start_update()
            state.update(mark=now(), **copy.deepcopy(fresh))

    return Recorder()


def main(args: rloo.Args) -> None:
    check_supported(args)  # before TRL's imports: a refused flag costs no TRL start-up
    rloo.compute_batch_sizes(args, world_size=1)  # the same clash errors as rloo.py
    import transformers
    import trl.trainer.rloo_trainer as trainer_module
    from transformers import PrinterCallback
    from trl import RLOOTrainer

    plumbing.check_new_output_dir(args.output_dir, plumbing.run_inputs(args))  # nothing there written over
    transformers.set_seed(args.seed)  # trl 0.21's trainer seeds only its prompt order
    plumbing.quiet_hub_progress_bars()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy, ref_policy, tokenizer, stop_token_id = rloo.load_policy(args, torch.device("cpu"))
    if ref_policy is None:  # TRL 0.21 always runs a reference model, also at kl_coef 0
        ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
    reward_model = plumbing.load_reward_model(args.reward_model_path, torch.bfloat16 if args.bf16 else torch.float32,
                                          args.trust_remote_code)
    if not plumbing.same_vocabulary(tokenizer, plumbing.load_tokenizer(args.reward_model_path, args.trust_remote_code)):
        raise plumbing.ConfigError("TRL 0.21's RLOOTrainer needs the reward model to share the policy's tokenizer")
    dataset, _, _ = plumbing.load_prompts(args, tokenizer, None, plumbing.prompt_token_ids)
    dataset = dataset.select_columns([plumbing.PROMPT_IDS]).rename_column(plumbing.PROMPT_IDS, "input_ids")
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = trl_config(args, use_cpu=device.type == "cpu")
    config.stop_token_id = stop_token_id
    trainer = RLOOTrainer(
        config=config, processing_class=tokenizer, policy=policy, ref_policy=ref_policy, reward_model=reward_model,
        train_dataset=dataset, eval_dataset=dataset.select(range(min(len(dataset), 8))),
        callbacks=[instrument(trainer_module, device, output_dir, plumbing.load_reward_functions(args.reward_fn),
                              tokenizer, stop_token_id, (policy, ref_policy, reward_model), args.rloo_k,
                              args.num_ppo_epochs)],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every metrics dict; the Recorder prints a line
    trainer.train()
    trainer.accelerator.unwrap_model(trainer.model).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


if __name__ == "__main__":
    plumbing.run_script(main, plumbing.parse_args(rloo.Args, prog="trl_rloo.py"), "trl_rloo.py")
