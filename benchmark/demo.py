"""Offline RLOO demo (`make demo`): build the synthetic task, train it with rloo.py, plot and check the result.

    python benchmark/demo.py [--total_episodes N] [--seed S] [--output_dir DIR] [--cache_dir DIR]

Fails (exit status 1) when the reward-model score did not rise by at least MIN_RISE.
"""

import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # `python benchmark/demo.py` only puts benchmark/ on the path

import plumbing  # noqa: E402
from plumbing import read_metrics  # noqa: E402
from benchmark.synthetic_task import ensure_assets, mean_true_score  # noqa: E402

MIN_RISE = 0.1  # required gain of the mean score, last 3 updates vs first 3
LOGGING_STEPS = 25  # a console line every this many updates (metrics.jsonl has every update)
EXP_NAME = "rloo_demo"  # the demo's runs' name: with the demo's inputs in a finished run's args.json, a demo's own


@dataclass
class Args:
    cache_dir: str = ".cache/rloo_demo"
    """where the tokenizer, SFT policy, reward model and prompts are built (reused on later runs)"""
    output_dir: str = "runs/demo"
    """rloo.py's output: metrics.jsonl, curves.png, the trained policy"""
    total_episodes: int = 40_000
    """completions to train on"""
    seed: int = 1
    """rloo.py's seed"""


def rloo_command(args: Args, assets: dict[str, str]) -> list[str]:
    """The rloo.py command line of the demo."""
    flags = {
        "model_name_or_path": assets["policy"],
        "reward_model_path": assets["reward_model"],
        "dataset_name": assets["train"],
        "dataset_test_split": assets["test"],
        "output_dir": args.output_dir,
        "rloo_k": 4,
        "per_device_train_batch_size": 64,
        "gradient_accumulation_steps": 1,
        "num_mini_batches": 1,
        "num_ppo_epochs": 1,
        "learning_rate": 3e-4,
        "kl_coef": 0.05,
        "response_length": 8,
        "max_prompt_length": 16,
        "temperature": 1.0,
        "total_episodes": args.total_episodes,
        "local_rollout_forward_batch_size": 128,
        "missing_eos_penalty": 1.0,
        "num_sample_generations": 2,
        "logging_steps": LOGGING_STEPS,
        "seed": args.seed,
        "exp_name": EXP_NAME,
    }
    return [sys.executable, "rloo.py"] + [s for key, value in flags.items() for s in (f"--{key}", str(value))] + [
        "--overwrite_output_dir"]  # what replace_previous_demo leaves (not a demo's finished run) moves to abandoned/


def replace_previous_demo(output_dir: str, assets: dict[str, str]) -> list[str]:
    """A finished earlier demo run in output_dir is deleted, so that each `make demo` replaces its own run instead of
    piling them up in output_dir/abandoned/: only a run whose args.json names this demo (EXP_NAME, its policy, its
    prompts, this output_dir), and only the files that run wrote (plumbing.run_owned; not abandoned/, nor anything
    else), under the directory's lock (a run in it now keeps it). Anything else, an unfinished run's files included,
    rloo.py's --overwrite_output_dir moves aside as before. Returns the names deleted."""
    root = Path(output_dir)
    record = plumbing.run_record(root) or {}
    ours = {"exp_name": EXP_NAME, "model_name_or_path": assets["policy"], "dataset_name": assets["train"],
            "output_dir": output_dir}
    if any(record.get(key) != value for key, value in ours.items()):
        return []
    lock = plumbing.OutputDirLock(output_dir)
    lock.acquire()
    try:
        names = [name for name in plumbing.run_owned(root) if name not in (plumbing.ABANDONED, plumbing.LOCK)]
        for name in names:
            path = root / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    finally:
        lock.release()
    return names


def read_prompts(path: str) -> list[str]:
    """The prompt column of a .jsonl file."""
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f]


def policy_true_score(model_path: str, prompts: list[str]) -> float:
    """Mean true score of a saved policy: 4 temperature-1 samples per prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    return mean_true_score(model, AutoTokenizer.from_pretrained(model_path), prompts, samples_per_prompt=4)


def stage(text: str) -> None:
    print(f"== {text}", flush=True)


def main(args: Args) -> None:
    start = time.time()
    transformers_logging.disable_progress_bar()
    args.output_dir = str(Path(args.output_dir).resolve())  # rloo.py runs from the repo root
    cache_dir = Path(args.cache_dir).resolve()
    stage(f"the task: tokenizer, prompts, an SFT policy and a reward model (built once, ~25 s on 2 idle cores, "
          f"a line per fifth of each model's steps; cached in {cache_dir})")
    assets = ensure_assets(cache_dir)
    metrics_path = Path(args.output_dir) / "metrics.jsonl"
    replaced = replace_previous_demo(args.output_dir, assets)
    if replaced:
        stage(f"the previous demo run in {args.output_dir} replaced ({len(replaced)} files and folders it wrote)")
    command = rloo_command(args, assets)
    stage(f"training with rloo.py: {args.total_episodes} completions, a line every {LOGGING_STEPS} updates (every "
          f"update's metrics in {metrics_path}); the command, a starting point for a small model of your own:")
    print("$ " + shlex.join(command), flush=True)
    returncode = subprocess.run(command, cwd=REPO_ROOT).returncode
    if returncode != 0:
        sys.exit(f"demo: rloo.py failed with exit status {returncode}")

    stage("scoring the SFT and the trained policy on the test prompts")
    scores = [row["objective/scores"] for row in read_metrics(metrics_path)]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    png_path = Path(args.output_dir) / "curves.png"  # drawn by the run itself (plumbing.plot_curves)
    prompts = read_prompts(assets["test"])
    sft_true, trained_true = policy_true_score(assets["policy"], prompts), policy_true_score(args.output_dir, prompts)
    print(f"reward-model score  first 3 updates {first:.3f} -> last 3 updates {last:.3f}")
    print(f"true score (test prompts, 4 samples each, T=1)  SFT policy {sft_true:.3f} -> RLOO policy {trained_true:.3f}")
    print(f"curves: {png_path}   total time {time.time() - start:.0f}s")
    if last - first < MIN_RISE:
        sys.exit(f"demo: FAILED - the score rose by {last - first:.3f}, less than {MIN_RISE}")


if __name__ == "__main__":
    plumbing.run_tool("demo.py", Args, main)
