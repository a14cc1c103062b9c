"""Learning of rloo.py and TRL's RLOOTrainer side by side, on the synthetic task of the demo.

    make bench-env                        # once: TRL 0.21 in benchmark/.venv-trl
    python benchmark/learning.py          # 3 seeds x (rloo.py, TRL), 16,000 episodes each

Both trainers get the same command line: the demo's hyper-parameters, the same SFT policy, reward model and
prompts, `--max_grad_norm 0` (TRL 0.21 never clips gradients) and the task's true score as a monitored reward
function of weight 0 (`--reward_fn benchmark.synthetic_task:true_reward --reward_weights 1 0`), so that both log it
per update without training on it. Seeds run alternately, rloo.py then TRL.

Reported per trainer (mean, min and max over seeds):
- the final policy's reward-model score and true score on the 64 test prompts, sampled (temperature 1, 4 samples
  per prompt) and greedy;
- the training seconds (sum of `time/update`) and when the smoothed training true score first reached TRL's final
  level. Curves of the reward-model score and the true score against episodes and against training seconds go to
  `<output_dir>/learning_episodes.png` and `learning_seconds.png`; the numbers to `learning.json` and `.md`.
"""

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import plumbing  # noqa: E402
from benchmark import demo  # noqa: E402
from benchmark.plot_metrics import moving_average  # noqa: E402
from benchmark.plot_runs import load_run, plot_grid  # noqa: E402
from benchmark.synthetic_task import ensure_assets, sample_completions, score_pairs, true_reward  # noqa: E402
from benchmark.throughput import TRAINERS, check_report, fresh_run_dir, run_trainer, trainer_commands  # noqa: E402

TRUE_SCORE = "reward/true_reward/mean"
SMOOTH = 10  # updates in the moving average of the training curves
WRITER = "benchmark/learning.py"  # the mark of its outputs: a path that exists is replaced only if it has it


@dataclass
class Args:
    seeds: tuple[int, ...] = (1, 2, 3)
    """one run of each trainer per seed"""
    total_episodes: int = 16_000
    """completions per run"""
    trl_python: str = "benchmark/.venv-trl/bin/python"
    """the Python of the environment with TRL 0.21 (`make bench-env`)"""
    cache_dir: str = ".cache/rloo_demo"
    """the synthetic task's assets (built on first use, shared with `make demo`)"""
    output_dir: str = "runs/bench"
    """where the table, JSON and PNGs go (runs/ is not tracked; `--output_dir benchmark/results` replaces the committed
    ones, on purpose)"""
    runs_dir: str = "runs/learning"
    """where each run's directory (metrics.jsonl, final policy) and its log (<directory>.log, beside it) go"""


def trainer_flags(args: Args, assets: dict[str, str], seed: int, output_dir: Path) -> list[str]:
    """The demo's rloo.py flags, with what makes the two trainers comparable."""
    flags = demo.rloo_command(demo.Args(output_dir=str(output_dir), total_episodes=args.total_episodes, seed=seed),
                              assets)[2:]  # drop the interpreter and rloo.py
    test_split = flags.index("--dataset_test_split")  # the final policies are evaluated here instead
    del flags[test_split : test_split + 2]
    return flags + ["--max_grad_norm", "0", "--num_sample_generations", "0",
                    "--reward_fn", "benchmark.synthetic_task:true_reward", "--reward_weights", "1", "0"]


@torch.no_grad()
def evaluate_policy(policy_dir: Path, reward_model, tokenizer, prompts: list[str]) -> dict[str, float]:
    """Reward-model score and true score of a saved policy's completions of `prompts`: sampled at temperature 1
    (4 per prompt) and greedy."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    out = {}
    for mode, temperature, repeat in (("sampled", 1.0, 4), ("greedy", 0.0, 1)):
        shown = [p for p in prompts for _ in range(repeat)]
        completions = sample_completions(policy, tokenizer, shown, temperature=temperature)
        out[f"true_score_{mode}"] = statistics.mean(true_reward(shown, completions))
        out[f"rm_score_{mode}"] = score_pairs(reward_model, tokenizer, shown, completions).mean().item()
    return out


def training_curve(run_dir: Path) -> dict[str, np.ndarray]:
    """The run's metrics with `time/elapsed`, the training seconds so far (cumulative `time/update`)."""
    run = load_run(run_dir)
    run["time/elapsed"] = np.cumsum(np.nan_to_num(run["time/update"]))
    return run


def seconds_to_reach(run: dict[str, np.ndarray], level: float) -> float | None:
    """Training seconds until the smoothed true score first reaches `level`; None if it never does."""
    smoothed = np.array(moving_average(run[TRUE_SCORE].tolist(), SMOOTH))
    reached = np.nonzero(smoothed >= level)[0]
    return float(run["time/elapsed"][reached[0]]) if len(reached) else None


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ({min(values):.3f} to {max(values):.3f})"


def main(args: Args) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not args.seeds or args.total_episodes < 1:
        raise plumbing.ConfigError(f"--seeds {' '.join(map(str, args.seeds))} --total_episodes {args.total_episodes}: "
                                   "at least one seed and one episode")
    check_report("learning", args, WRITER, others=("learning_episodes.png", "learning_seconds.png"))  # before any run

    commands = trainer_commands(args.trl_python, "learning")
    start = time.time()
    assets = ensure_assets((REPO_ROOT / args.cache_dir).resolve())
    tokenizer = AutoTokenizer.from_pretrained(assets["policy"])
    reward_model = AutoModelForSequenceClassification.from_pretrained(assets["reward_model"], num_labels=1).eval()
    prompts = demo.read_prompts(assets["test"])
    runs = {name: {} for name in TRAINERS}
    results = {name: [] for name in TRAINERS}
    for seed in args.seeds:
        for name, command in commands.items():
            run_dir = fresh_run_dir(REPO_ROOT / args.runs_dir / f"{name.replace('.', '_')}_seed{seed}")
            wall, _ = run_trainer(command + trainer_flags(args, assets, seed, run_dir),
                                  run_dir.parent / f"{run_dir.name}.log", "learning")
            runs[name][f"seed {seed}"] = training_curve(run_dir)
            final = evaluate_policy(run_dir, reward_model, tokenizer, prompts)
            results[name].append({"seed": seed, "wall_seconds": wall,
                                  "training_seconds": float(runs[name][f"seed {seed}"]["time/elapsed"][-1]), **final})
            print(f"{name} seed {seed}: {json.dumps(results[name][-1])}", flush=True)

    trl_final = statistics.mean(r["true_score_sampled"] for r in results["trl"])
    trl_curve_final = statistics.mean(
        float(np.mean(run[TRUE_SCORE][-SMOOTH:])) for run in runs["trl"].values())  # TRL's smoothed final level
    for name in TRAINERS:
        for result, run in zip(results[name], runs[name].values()):
            result["seconds_to_trl_final_true_score"] = seconds_to_reach(run, trl_curve_final)

    keys = ("true_score_sampled", "true_score_greedy", "rm_score_sampled", "rm_score_greedy", "training_seconds")
    lines = ["| trainer | " + " | ".join(keys) + " | seconds to TRL's final training true score |",
             "|---" * (len(keys) + 2) + "|"]
    for name in TRAINERS:
        reach = [r["seconds_to_trl_final_true_score"] for r in results[name]]
        reach_text = spread(reach) if None not in reach else f"not reached by {reach.count(None)} seed(s)"
        lines.append(f"| {name} | " + " | ".join(spread([r[k] for r in results[name]]) for k in keys)
                     + f" | {reach_text} |")
    table = "\n".join(lines)
    print(table)
    output_dir = REPO_ROOT / args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    metrics = ("objective/scores", TRUE_SCORE)
    plot_grid(runs, output_dir / "learning_episodes.png", metrics, smooth=SMOOTH, writer=WRITER)
    plot_grid(runs, output_dir / "learning_seconds.png", metrics, smooth=SMOOTH, x="time/elapsed",
              xlabel="training seconds (sum of time/update)", writer=WRITER)
    report = {"config": asdict(args), "flags": trainer_flags(args, assets, 0, Path("RUN_DIR")),
              "trl_final_true_score_sampled": trl_final, "trl_final_training_true_score": trl_curve_final,
              "results": results, "seconds": time.time() - start}
    plumbing.write_own(output_dir / "learning.json", json.dumps({"written_by": WRITER, **report}, indent=2) + "\n")
    plumbing.write_own(output_dir / "learning.md", plumbing.marked_text(
        f"Mean (min to max) over seeds {list(args.seeds)}, {args.total_episodes} episodes each.\n\n{table}\n\n",
        WRITER))
    print(f"wrote {output_dir}/learning.json, .md and the PNGs ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    plumbing.run_tool("learning.py", Args, main)
