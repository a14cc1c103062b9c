"""Throughput of rloo.py and TRL's RLOOTrainer side by side, on the identical configuration.

    make bench-env                                   # once: TRL 0.21 in benchmark/.venv-trl
    python benchmark/throughput.py                   # CPU defaults: pythia-14m shape, 3 x (rloo.py, TRL)
    python benchmark/throughput.py --shapes pythia-1b --prompt_length 512 --bf16 --per_device_train_batch_size 16

For each model shape the script builds, from a config and with no download, a random-init policy, a random-init
reward model of the same shape, a word-level tokenizer covering the vocabulary and prompts of exactly
`prompt_length` random tokens. It then runs `rloo.py` and `benchmark/trl_rloo.py` (TRL, in its own environment)
alternately, A B A B, with the same flags: same k, prompts per update, lengths, PPO epochs and minibatches. There is
no stop token, so every completion has `response_length` tokens in both and the work per update is equal.

Per run, over the updates after the warm-up ones: episodes/s (completions per second of update), generated
tokens/s, seconds per phase, and peak memory (the process's maximum RSS on CPU, the maximum allocated on CUDA).
Then the ratio rloo.py / TRL of episodes/s over the A/B pairs, min / median / max. Written: a table on stdout,
`<output_dir>/throughput_<device>.json` and `.md`.
"""

import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import tyro

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmark.synthetic_task import save_tokenizer  # noqa: E402

# Pythia shapes (EleutherAI/pythia-*-deduped configs): hidden size, layers, attention heads
PYTHIA_SHAPES = {
    "pythia-14m": (128, 6, 4),
    "pythia-70m": (512, 6, 8),
    "pythia-160m": (768, 12, 12),
    "pythia-410m": (1024, 24, 16),
    "pythia-1b": (2048, 16, 8),
    "pythia-2.8b": (2560, 32, 32),
    "pythia-6.9b": (4096, 32, 32),
}
PYTHIA_VOCAB = 50304
PHASES = ("generation", "policy_forward", "reference_forward", "scoring", "training")
TRAINERS = ("rloo.py", "trl")  # the keys of trainer_commands


@dataclass
class RunConfig:
    """The runs' shape and settings, shared with benchmark/options_cost.py."""

    shapes: tuple[str, ...] = ("pythia-14m",)
    """model shapes to measure, from: pythia-14m, -70m, -160m, -410m, -1b, -2.8b, -6.9b"""
    updates: int = 4
    """updates per run"""
    warmup_updates: int = 1
    """first updates of each run left out of the averages (allocator and kernel warm-up)"""
    prompt_length: int = 64
    """prompt tokens (TL;DR: 512)"""
    response_length: int = 53
    """generated tokens per completion (TL;DR: 53)"""
    rloo_k: int = 2
    """completions per prompt"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass"""
    gradient_accumulation_steps: int = 2
    """micro-batches per optimizer step"""
    num_mini_batches: int = 2
    """optimizer steps per PPO epoch"""
    num_ppo_epochs: int = 2
    """passes over each batch of completions"""
    local_rollout_forward_batch_size: int = 32
    """completions per generation / scoring chunk"""
    bf16: bool = False
    """bf16 autocast and frozen models (GPU)"""
    cache_dir: str = ".cache/throughput"
    """where the random-init models and prompts are built (reused)"""
    output_dir: str = "benchmark/results"
    """where the JSON and Markdown results go"""
    runs_dir: str = "runs/throughput"
    """where each run's directory (metrics.jsonl, log.txt, final policy) goes"""
    seed: int = 1
    """seed of both trainers"""


@dataclass
class Args(RunConfig):
    repeats: int = 3
    """A/B pairs per shape (rloo.py, then TRL, `repeats` times)"""
    compile_generation: bool = False
    """rloo.py only: --compile_generation (static KV cache, compiled decoding step; TRL 0.21 has no equivalent).
    The compilation falls in the warm-up update"""
    trl_python: str = "benchmark/.venv-trl/bin/python"
    """the Python of the environment with TRL 0.21 (`make bench-env`)"""


# ---------------------------------------------------------------- assets


def build_tokenizer(vocab_size: int):
    """Word-level tokenizer over `vocab_size` ids: `<pad>`=0, `<eos>`=1, `<unk>`=2, then `w3`, `w4`, ..."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def pythia_config(shape: str, **overrides):
    from transformers import GPTNeoXConfig

    hidden, layers, heads = PYTHIA_SHAPES[shape]
    return GPTNeoXConfig(
        vocab_size=PYTHIA_VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1, **overrides,
    )


def ensure_shape_assets(shape: str, cache_dir: Path, num_prompts: int, prompt_length: int) -> dict[str, str]:
    """Random-init policy and reward model of `shape`, their tokenizer, and `num_prompts` prompts (built once)."""
    from transformers import GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    root = cache_dir / shape
    paths = {"policy": root / "policy", "reward_model": root / "reward_model",
             "prompts": root / f"prompts_{num_prompts}x{prompt_length}.jsonl"}
    tokenizer = None
    for name, model_class, seed, extra in (("policy", GPTNeoXForCausalLM, 0, {}),
                                           ("reward_model", GPTNeoXForSequenceClassification, 1, {"num_labels": 1})):
        if not (paths[name] / "config.json").exists():
            tokenizer = tokenizer or build_tokenizer(PYTHIA_VOCAB)
            torch.manual_seed(seed)
            model_class(pythia_config(shape, **extra)).save_pretrained(paths[name])
            save_tokenizer(tokenizer, paths[name])
    if not paths["prompts"].exists():
        rng = random.Random(0)
        rows = [{"prompt": " ".join(f"w{rng.randrange(3, PYTHIA_VOCAB)}" for _ in range(prompt_length))}
                for _ in range(num_prompts)]
        paths["prompts"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {name: str(path) for name, path in paths.items()}


# ---------------------------------------------------------------- runs


def trainer_flags(args: RunConfig, assets: dict[str, str], output_dir: Path) -> list[str]:
    """The flags both trainers get. `--max_grad_norm 0`: TRL 0.21 never clips gradients."""
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    flags = {
        "model_name_or_path": assets["policy"], "reward_model_path": assets["reward_model"],
        "dataset_name": assets["prompts"], "output_dir": str(output_dir), "seed": args.seed,
        "rloo_k": args.rloo_k, "kl_coef": 0.05, "temperature": 0.7, "stop_token": "None",
        "response_length": args.response_length, "max_prompt_length": args.prompt_length,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps, "num_mini_batches": args.num_mini_batches,
        "num_ppo_epochs": args.num_ppo_epochs, "local_rollout_forward_batch_size": args.local_rollout_forward_batch_size,
        "total_episodes": batch * args.updates, "learning_rate": 3e-6, "max_grad_norm": 0,
        "num_sample_generations": 0, "num_evals": 0,
    }
    return [s for key, value in flags.items() for s in (f"--{key}", str(value))] + (["--bf16"] if args.bf16 else [])


def trainer_commands(trl_python: str, program: str) -> dict[str, list[str]]:
    """Each trainer's command: rloo.py in this environment, benchmark/trl_rloo.py in the TRL one (exits with the
    fix when that environment is missing). Shared by throughput.py and learning.py."""
    path = REPO_ROOT / trl_python
    if not path.exists():
        sys.exit(f"{program}: no TRL environment at {trl_python}: run `make bench-env` or pass --trl_python")
    return {"rloo.py": [sys.executable, "rloo.py"], "trl": [str(path), "benchmark/trl_rloo.py"]}


def fresh_run_dir(path: Path) -> Path:
    """An empty run directory: rloo.py refuses to start over a directory that holds an earlier run."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def run_trainer(command: list[str], log_path: Path, program: str) -> tuple[float, float]:
    """Run a trainer to the end, its output in log_path. Returns its wall-clock seconds (start-up included) and
    its peak RSS in GiB (this child's own, from wait4)."""
    print("$ " + shlex.join(command), flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        tail = log_path.read_text().splitlines()[-15:]
        sys.exit(f"{program}: a trainer failed:\n" + "\n".join(tail) + f"\n(full log: {log_path})")
    return time.time() - start, usage.ru_maxrss / 2**20  # KiB on Linux


def summarize_run(metrics_path: Path, args: RunConfig, rss_gib: float) -> dict:
    """Averages over the measured updates of one run."""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [row for row in rows if "time/update" in row][args.warmup_updates:]
    if not rows:
        sys.exit(f"throughput: {metrics_path} has no update after the {args.warmup_updates} warm-up ones: "
                 f"raise --updates")
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    update_s = statistics.mean(row["time/update"] for row in rows)
    out = {
        "updates_measured": len(rows),
        "seconds_per_update": update_s,
        "episodes_per_s": batch / update_s,
        "generated_tokens_per_s": batch * args.response_length / update_s,
        "peak_rss_gib": rss_gib,
        **{f"{phase}_s": statistics.mean(row.get(f"time/{phase}", 0.0) for row in rows) for phase in PHASES},
    }
    peaks = [row["memory/peak_gib"] for row in rows if "memory/peak_gib" in row]
    if peaks:
        out["peak_allocated_gib"] = max(peaks)
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def hardware() -> dict:
    info = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------- report


def ratio_stats(ours: list[dict], trl: list[dict]) -> dict:
    ratios = sorted(a["episodes_per_s"] / b["episodes_per_s"] for a, b in zip(ours, trl))
    return {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}


def markdown_table(summary: dict) -> str:
    lines = ["| shape | trainer | episodes/s | tokens/s | s/update | " + " | ".join(PHASES) + " | peak memory GiB |",
             "|---" * (6 + len(PHASES)) + "|"]
    for shape, result in summary.items():
        for name in TRAINERS:
            runs = result[name]
            med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            memory = med.get("peak_allocated_gib", med["peak_rss_gib"])
            lines.append(f"| {shape} | {name} | {med['episodes_per_s']:.1f} | {med['generated_tokens_per_s']:.0f} | "
                         f"{med['seconds_per_update']:.2f} | "
                         + " | ".join(f"{med[f'{phase}_s']:.2f}" for phase in PHASES) + f" | {memory:.2f} |")
        r = result["ratio"]
        lines.append(f"| {shape} | **rloo.py / TRL** | **{r['median']:.2f}x** (min {r['min']:.2f}, max {r['max']:.2f}) |"
                     + " |" * (3 + len(PHASES)))
    return "\n".join(lines)


def main(args: Args) -> None:
    unknown = [s for s in args.shapes if s not in PYTHIA_SHAPES]
    if unknown:
        sys.exit(f"throughput: unknown shape(s) {unknown}; choose from {list(PYTHIA_SHAPES)}")
    commands = trainer_commands(args.trl_python, "throughput")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    start, summary = time.time(), {}
    for shape in args.shapes:
        assets = ensure_shape_assets(shape, (REPO_ROOT / args.cache_dir).resolve(), batch // args.rloo_k * args.updates,
                                     args.prompt_length)
        results = {name: [] for name in TRAINERS}
        for repeat in range(args.repeats):
            for name, command in commands.items():
                run_dir = fresh_run_dir(REPO_ROOT / args.runs_dir / f"{shape}_{name.replace('.', '_')}_{repeat}")
                own = ["--compile_generation"] if args.compile_generation and name == "rloo.py" else []
                _, rss = run_trainer(command + trainer_flags(args, assets, run_dir) + own, run_dir / "log.txt",
                                     "throughput")
                results[name].append(summarize_run(run_dir / "metrics.jsonl", args, rss))
                print(f"{shape} {name} repeat {repeat}: {results[name][-1]['episodes_per_s']:.1f} episodes/s", flush=True)
        results["ratio"] = ratio_stats(results["rloo.py"], results["trl"])
        summary[shape] = results
    table = markdown_table(summary)
    print(table)
    output_dir = REPO_ROOT / args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    report = {"hardware": hardware(), "config": asdict(args), "completions_per_update": batch, "results": summary,
              "seconds": time.time() - start}
    (output_dir / f"throughput_{device}.json").write_text(json.dumps(report, indent=2) + "\n")
    (output_dir / f"throughput_{device}.md").write_text(
        f"Hardware: {json.dumps(report['hardware'])}\n\nConfig: {json.dumps(asdict(args))}\n\n{table}\n")
    print(f"wrote {output_dir}/throughput_{device}.json and .md ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    main(tyro.cli(Args))
