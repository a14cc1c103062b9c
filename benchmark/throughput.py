"""Throughput of rloo.py and TRL's RLOOTrainer side by side, on the identical configuration.

    make bench-env                                   # once: TRL 0.21 in benchmark/.venv-trl, TRL 1.16 in .trl116-site
    python benchmark/throughput.py                   # TL;DR-like lengths, pythia-70m shape, k = 2 and 4
    python benchmark/throughput.py --lengths fixed --prompt_length 64 --shapes pythia-14m --rloo_ks 2 \
        --num_ppo_epochs 2 --num_mini_batches 2 --mean_response_length None    # the short-prompt setting
    python benchmark/throughput.py --shapes pythia-1b --bf16 --per_device_train_batch_size 16    # on a GPU

For each model shape the script builds, from a config and with no download, a random-init policy, a random-init
reward model of the same shape, a word-level tokenizer covering the vocabulary, and prompts of random tokens:
`--lengths tldr` draws each prompt's length like TL;DR's queries (normal, mean 350, standard deviation 60,
clipped to 64..prompt_length; a stand-in for the real distribution: mean ~347, median ~352, max 512), `fixed`
makes every prompt prompt_length tokens. With --mean_response_length M the policy's EOS is made likely enough
(calibrate_stop_token) that responses end after about M tokens (TL;DR's reference summaries: mean ~34, max 53),
and both trainers stop at it; without, every completion has response_length tokens and the work is equal. It then
runs `rloo.py` and `benchmark/trl_rloo.py` (TRL, in its own environment) alternately, A B A B, with the same
flags: same k, prompts per update, lengths, PPO epochs and minibatches; and TRL 1.16 (`benchmark/trl116_rloo.py`,
the settings mapped to its names) third in each round (--trls picks them).

Per run, over the updates after the warm-up ones: episodes/s (completions per second of update), generated
tokens/s, seconds per phase, the work (token positions fed through the models' forward passes per update, against
the minimum: every prompt token once per pass, every response token once per completion), generation's achieved
memory bandwidth (the bytes its decoding steps must read, every weight and the whole KV cache each step, over
its seconds: a lower bound, as those seconds also hold the prefill and sampling), and peak memory (the process's
maximum RSS on CPU, the maximum allocated on CUDA). Then how far each phase is from the machine's limits
(benchmark/accounting.py): its achieved FLOP/s (2 N T forward, 6 N T training; N the blocks' parameters, T the
phase's token positions) against a matmul measured here, and decoding's GB/s against a memory copy measured here.
Then the ratio rloo.py / TRL of episodes/s over the A/B pairs (each TRL), min / median / max. Written: a table on stdout, `<output_dir>/throughput_<device>.json` and `.md`.
"""

import contextlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import plumbing  # noqa: E402
from benchmark import accounting  # noqa: E402
from benchmark.synthetic_task import save_tokenizer  # noqa: E402

WRITER = "benchmark/throughput.py"  # the mark of its reports: a path that exists is replaced only if it has it

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
TRL_NAMES = {"trl": "TRL 0.21", "trl116": "TRL 1.16"}  # the TRL trainers throughput.py sets rloo.py against


@dataclass
class RunConfig:
    """The runs' shape and settings, shared with benchmark/options_cost.py."""

    shapes: tuple[str, ...] = ("pythia-14m",)
    """model shapes to measure, from: pythia-14m, -70m, -160m, -410m, -1b, -2.8b, -6.9b"""
    updates: int = 4
    """updates per run"""
    warmup_updates: int = 1
    """first updates of each run left out of the averages (allocator and kernel warm-up)"""
    lengths: Literal["tldr", "fixed"] = "fixed"
    """prompt lengths: tldr, drawn like TL;DR's queries (mean 350, sd 60, clipped to 64..prompt_length); fixed, all
    prompt_length"""
    prompt_length: int = 64
    """the longest prompt, in tokens (TL;DR: 512), and with --lengths fixed every prompt's length"""
    response_length: int = 53
    """the most tokens generated per completion (TL;DR: 53)"""
    mean_response_length: Optional[float] = None
    """responses end at EOS after about this many tokens (the policy's EOS calibrated to it); None: no stop token,
    every completion response_length tokens (equal work in both trainers)"""
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
    output_dir: str = "runs/bench"
    """where the JSON and Markdown results go (runs/ is not tracked; `--output_dir benchmark/results` replaces the
    committed ones, on purpose)"""
    runs_dir: str = "runs/throughput"
    """where each run's directory (metrics.jsonl, final policy) and its log (<directory>.log, beside it) go"""
    seed: int = 1
    """seed of both trainers"""


def check_run_config(args: RunConfig) -> None:
    """The numbers of RunConfig a run of either trainer cannot take, refused in one line before anything is built;
    rloo.py checks the rest of its flags itself."""
    unknown = [s for s in args.shapes if s not in PYTHIA_SHAPES]
    if unknown:
        raise plumbing.ConfigError(f"--shapes: unknown shape(s) {unknown}; choose from {list(PYTHIA_SHAPES)}")
    for flag, value, allowed, requirement in [
        ("updates", args.updates, args.updates > args.warmup_updates >= 0,
         f"more than --warmup_updates ({args.warmup_updates}, >= 0): the averages need an update after them"),
        ("prompt_length", args.prompt_length, args.prompt_length >= 1, "at least 1"),
        ("response_length", args.response_length, args.response_length >= 1, "at least 1"),
        ("mean_response_length", args.mean_response_length, args.mean_response_length is None
         or 0 < args.mean_response_length <= args.response_length, "in (0, --response_length], or None"),
        *[(name, getattr(args, name), getattr(args, name) >= 1, "at least 1") for name in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs",
            "local_rollout_forward_batch_size", *(["repeats"] if hasattr(args, "repeats") else []))],
    ]:
        if not allowed:
            raise plumbing.ConfigError(f"--{flag} {value}: must be {requirement}")


@dataclass
class Args(RunConfig):
    shapes: tuple[str, ...] = ("pythia-70m",)
    """model shapes to measure, from: pythia-14m, -70m, -160m, -410m, -1b, -2.8b, -6.9b"""
    lengths: Literal["tldr", "fixed"] = "tldr"
    """prompt lengths: tldr, drawn like TL;DR's queries (mean 350, sd 60, clipped to 64..prompt_length); fixed, all
    prompt_length"""
    prompt_length: int = 512
    """the longest prompt, in tokens (TL;DR: 512), and with --lengths fixed every prompt's length"""
    mean_response_length: Optional[float] = 34.0
    """responses end at EOS after about this many tokens (the policy's EOS calibrated to it); None: no stop token,
    every completion response_length tokens (equal work in both trainers)"""
    local_rollout_forward_batch_size: int = 8
    """completions per generation / scoring chunk, both trainers: the micro-batch, as TRL >= 0.22 sets it (a chunk
    pads to its own longest prompt and response)"""
    rloo_ks: tuple[int, ...] = (2, 4)
    """completions per prompt: one comparison each, at the same completions per update"""
    num_mini_batches: int = 1
    """optimizer steps per PPO epoch"""
    num_ppo_epochs: int = 1
    """passes over each batch of completions (1 epoch, 1 minibatch: on-policy)"""
    updates: int = 3
    """updates per run"""
    repeats: int = 2
    """A/B pairs per shape (rloo.py, then TRL, `repeats` times)"""
    compile_generation: bool = False
    """rloo.py only: --compile_generation (static KV cache, compiled decoding step; TRL 0.21 has no equivalent).
    The compilation falls in the warm-up update"""
    bf16_generation: bool = False
    """rloo.py only: --bf16_generation (sampling from a bf16 copy of the policy, refreshed after each update; the
    trained policy and every log-prob stay fp32). TRL 0.21 has no equivalent"""
    trl_python: str = "benchmark/.venv-trl/bin/python"
    """the Python of the environment with TRL 0.21 (`make bench-env`)"""
    trls: tuple[Literal["trl", "trl116"], ...] = ("trl", "trl116")
    """the TRL trainers rloo.py is set against, each after it in every round: trl, TRL 0.21 (benchmark/trl_rloo.py in
    --trl_python); trl116, TRL 1.16 (benchmark/trl116_rloo.py in this Python, --trl116_site first on PYTHONPATH)"""
    trl116_site: str = "benchmark/.trl116-site"
    """a folder holding TRL 1.16 (`make bench-env`)"""


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


TLDR_QUERY_MEAN, TLDR_QUERY_SD, SHORTEST_PROMPT = 350, 60, 64


def prompt_lengths(lengths: str, num_prompts: int, longest: int, seed: int = 0) -> list[int]:
    """Each prompt's length: TL;DR-like (normal, mean 350, sd 60, clipped to 64..longest) or all `longest`."""
    if lengths == "fixed":
        return [longest] * num_prompts
    rng = random.Random(seed)
    return [min(longest, max(SHORTEST_PROMPT, round(rng.gauss(TLDR_QUERY_MEAN, TLDR_QUERY_SD))))
            for _ in range(num_prompts)]


@torch.no_grad()
def calibrate_stop_token(model, stop_id: int, temperature: float, mean_length: float, max_length: int) -> float:
    """Make a random-init causal LM emit stop_id often enough that sampled responses end after about mean_length
    tokens (at most max_length); it otherwise draws it with probability 1/V per token. Its output row becomes
    alpha * u, u the mean direction of the final hidden states (on random text), alpha set by bisection so that the
    mean per-token probability p gives that mean for a geometric length capped at max_length:
    (1 - (1 - p)^max_length) / p = mean_length. Returns p."""
    low, high = 1e-6, 1.0  # p for the mean length, by bisection (the mean falls as p rises)
    for _ in range(60):
        p = (low + high) / 2
        low, high = (p, high) if (1 - (1 - p) ** max_length) / p > mean_length else (low, p)
    ids = torch.randint(3, model.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0))
    hidden = model.base_model(input_ids=ids).last_hidden_state.flatten(0, 1)  # (N, H)
    head = model.get_output_embeddings().weight  # (V, H)
    others = torch.cat([head[:stop_id], head[stop_id + 1 :]])
    log_rest = torch.logsumexp(hidden @ others.T / temperature, dim=-1)  # (N,)
    u = hidden.mean(0) / hidden.mean(0).norm()
    along = hidden @ u / temperature  # (N,)
    low_alpha, high_alpha = 0.0, 1e4
    for _ in range(100):
        alpha = (low_alpha + high_alpha) / 2
        stop_probability = torch.sigmoid(alpha * along - log_rest).mean().item()
        low_alpha, high_alpha = (alpha, high_alpha) if stop_probability < p else (low_alpha, alpha)
    head[stop_id] = alpha * u
    return p


def shape_asset_paths(shape: str, cache_dir: Path, num_prompts: int, config: RunConfig) -> dict[str, Path]:
    """Where ensure_shape_assets keeps the policy, the reward model (each a folder with its config.json once built)
    and the prompts."""
    root = cache_dir / shape
    stops = f"_eos{config.mean_response_length:g}of{config.response_length}" if config.mean_response_length else ""
    return {"policy": root / f"policy{stops}", "reward_model": root / "reward_model",
            "prompts": root / f"prompts_{config.lengths}_{num_prompts}x{config.prompt_length}.jsonl"}


def ensure_shape_assets(shape: str, cache_dir: Path, num_prompts: int, config: RunConfig) -> dict[str, str]:
    """Random-init policy and reward model of `shape`, their tokenizer, and `num_prompts` prompts (built once)."""
    from transformers import GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    paths = shape_asset_paths(shape, cache_dir, num_prompts, config)
    tokenizer = None
    for name, model_class, seed, extra in (("policy", GPTNeoXForCausalLM, 0, {}),
                                           ("reward_model", GPTNeoXForSequenceClassification, 1, {"num_labels": 1})):
        if not (paths[name] / "config.json").exists():
            tokenizer = tokenizer or build_tokenizer(PYTHIA_VOCAB)
            torch.manual_seed(seed)
            model = model_class(pythia_config(shape, **extra))
            if name == "policy" and config.mean_response_length:
                calibrate_stop_token(model, tokenizer.eos_token_id, 0.7, config.mean_response_length,
                                     config.response_length)
            model.save_pretrained(paths[name])
            save_tokenizer(tokenizer, paths[name])
    if not paths["prompts"].exists():
        rng = random.Random(0)
        rows = [{"prompt": " ".join(f"w{rng.randrange(3, PYTHIA_VOCAB)}" for _ in range(length))}
                for length in prompt_lengths(config.lengths, num_prompts, config.prompt_length)]
        paths["prompts"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {name: str(path) for name, path in paths.items()}


# ---------------------------------------------------------------- runs


def trainer_flags(args: RunConfig, k: int, assets: dict[str, str], output_dir: Path) -> list[str]:
    """The flags both trainers get. `--max_grad_norm 0`: TRL 0.21 never clips gradients."""
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    flags = {
        "model_name_or_path": assets["policy"], "reward_model_path": assets["reward_model"],
        "dataset_name": assets["prompts"], "output_dir": str(output_dir), "seed": args.seed,
        "rloo_k": k, "kl_coef": 0.05, "temperature": 0.7,
        "stop_token": "eos" if args.mean_response_length else "None",
        "response_length": args.response_length, "max_prompt_length": args.prompt_length,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps, "num_mini_batches": args.num_mini_batches,
        "num_ppo_epochs": args.num_ppo_epochs, "local_rollout_forward_batch_size": args.local_rollout_forward_batch_size,
        "total_episodes": batch * args.updates, "learning_rate": 3e-6, "max_grad_norm": 0,
        "num_sample_generations": 0, "num_evals": 0,
    }
    return [s for key, value in flags.items() for s in (f"--{key}", str(value))] + (["--bf16"] if args.bf16 else [])


def trl_environment_problem(python: Path) -> str | None:
    """Why `python` cannot run benchmark/trl_rloo.py, with the fix; None when it can. `make bench-env` marks a
    finished install (.rloo-installed-lock*, as the Makefile's BENCH_INSTALLED); an environment without the mark
    (an interrupted install, or one set up by hand) must import trl. Shared with tests/test_bench_compare.py."""
    if not python.exists():
        return f"no TRL environment at {python}: run `make bench-env`"
    if any(python.parent.parent.glob(".rloo-installed-lock*")):
        return None
    if subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode != 0:
        return (f"the TRL environment at {python.parent.parent} is half-built (`make bench-env` did not mark it "
                "finished and `import trl` fails in it): run `make bench-env`, which finishes it")
    return None


def trainer_commands(trl_python: str, program: str) -> dict[str, list[str]]:
    """Each trainer's command: rloo.py in this environment, benchmark/trl_rloo.py in the TRL one (exits with the
    fix when that environment is missing or half-built). Shared by throughput.py and learning.py."""
    path = REPO_ROOT / trl_python
    problem = trl_environment_problem(path)
    if problem:
        sys.exit(f"{program}: {problem}, or pass --trl_python")
    return {"rloo.py": [sys.executable, "rloo.py"], "trl": [str(path), "benchmark/trl_rloo.py"]}


def trl116_command(site: str) -> tuple[list[str], Optional[str]]:
    """The command that runs benchmark/trl116_rloo.py (this Python, the folder `site` first on PYTHONPATH), and why
    it cannot run (one line, with the fix), or None: the trl that import would find there, by its metadata (importing
    TRL takes seconds; the runner checks the version it imports). Shared with gpu_suite.py."""
    from importlib.metadata import distributions

    from benchmark.trl116_rloo import TRL_VERSION

    path = os.pathsep.join(filter(None, [str(REPO_ROOT / site), os.environ.get("PYTHONPATH", "")]))
    found = next(iter(distributions(name="trl", path=[str(REPO_ROOT / site), *sys.path])), None)
    problem = None if found is not None and found.version == TRL_VERSION else (
        f"TRL {TRL_VERSION} not importable with {site} first on PYTHONPATH "
        f"({'it has trl ' + found.version if found else 'no trl'}): run `make bench-env`")
    return ["env", f"PYTHONPATH={path}", sys.executable, "benchmark/trl116_rloo.py"], problem


def drop_weights(run_dir: Path) -> None:
    """A measured run's weights removed (its checkpoints, and the final model's weight files), its metrics, args and
    log kept: a pythia-1b run writes about 12 GB (the fp32 policy, and the last checkpoint with AdamW's moments), and
    a GPU machine's disk holds only a few such runs (a 64 GiB disk filled at the fifth). Only inside a run directory
    this module made (fresh_run_dir); a link is removed as a link, never followed."""
    for path in run_dir.iterdir():
        if path.name == "checkpoints" and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.suffix in (".safetensors", ".bin", ".pt") and (path.is_file() or path.is_symlink()):
            path.unlink()


def fresh_run_dir(path: Path) -> Path:
    """An empty run directory: rloo.py refuses to start over a directory that holds an earlier run. What is there
    is removed only if it is an earlier run's (a trainer's metrics.jsonl, or only what an rloo.py run writes,
    plumbing.run_owned): a directory of the user's that happens to have the name is refused, never deleted, and a
    link is not followed."""
    if path.is_symlink() or path.exists() and not path.is_dir():
        what = "a symbolic link" if path.is_symlink() else "not a directory"
        raise plumbing.ConfigError(f"{path} is in the way of a benchmark run ({what}): move it, or pass another "
                                   "--runs_dir")
    if path.is_dir():
        names = {p.name for p in path.iterdir()}
        if "metrics.jsonl" not in names and names - set(plumbing.run_owned(path)):
            raise plumbing.ConfigError(f"{path} holds {', '.join(sorted(names)[:3])} and no run's metrics.jsonl: a "
                                       "benchmark run replaces only an earlier run's directory; move it, or pass "
                                       "another --runs_dir")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process below it (a trainer's engines and their workers): killing the trainer
    alone would leave them running, holding the GPU. Read from /proc, descendants first found, then killed."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except OSError:  # ended meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, i = [pid], 0
    while i < len(tree):
        tree += parents.get(tree[i], [])
        i += 1
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def run_trainer(command: list[str], log_path: Path, program: str,
                timeout: Optional[float] = None) -> tuple[float, float]:
    """Run a trainer to the end, its output in log_path; one still running after `timeout` seconds is killed (the
    GPU suite's budget) and the program exits saying so. Returns its wall-clock seconds (start-up included) and
    its peak RSS in GiB (this child's own, from wait4)."""
    print("$ " + shlex.join(command), flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        timer = threading.Timer(max(timeout, 0.0), kill_tree, (process.pid,)) if timeout is not None else None
        if timer:
            timer.daemon = True
            timer.start()
        _, status, usage = os.wait4(process.pid, 0)
        if timer:
            timer.cancel()
    if timeout is not None and time.time() - start >= timeout and os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{program}: a trainer still running after {timeout:.0f} s, the time its budget left it, was "
                 f"stopped (its log: {log_path})")
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
        "generated_tokens_per_s": batch * statistics.mean(row["completions/mean_length"] for row in rows) / update_s,
        "mean_response_length": statistics.mean(row["completions/mean_length"] for row in rows),
        "peak_rss_gib": rss_gib,
        **{f"{phase}_s": statistics.mean(row.get(f"time/{phase}", 0.0) for row in rows) for phase in PHASES},
        **{f"{phase}_tokens": statistics.mean(row.get(f"work/{phase}_tokens", 0.0) for row in rows)
           for phase in PHASES},
        "forward_tokens": statistics.mean(row["work/forward_tokens"] for row in rows),
        "minimum_tokens": statistics.mean(row["work/minimum_tokens"] for row in rows),
    }
    out["work_x_minimum"] = out["forward_tokens"] / out["minimum_tokens"]
    decode_bytes = [row["work/decode_bytes"] for row in rows if "work/decode_bytes" in row]
    if decode_bytes:  # a lower bound: generation's time also holds the prefill and the sampling
        out["generation_gb_per_s"] = statistics.mean(decode_bytes) / out["generation_s"] / 1e9
    peaks = [row["memory/peak_gib"] for row in rows if "memory/peak_gib" in row]
    if peaks:
        out["peak_allocated_gib"] = max(peaks)
    for phase in PHASES:  # CUDA: each phase's own peak
        phase_peaks = [row[f"memory/{phase}_gib"] for row in rows if f"memory/{phase}_gib" in row]
        if phase_peaks:
            out[f"{phase}_peak_gib"] = max(phase_peaks)
    return out


def limits_rows(summary: dict, shapes: dict[str, int], peaks: dict) -> dict[str, dict]:
    """accounting.achieved for the median run of each configuration and trainer; `shapes` maps a configuration to
    its block parameter count."""
    rows = {}
    for configuration, result in summary.items():
        for name in trainers_of(result):
            runs = result[name]
            median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            rows[f"{configuration} {name}"] = {**median, **accounting.achieved(median, shapes[configuration], peaks)}
    return rows


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def hardware() -> dict:
    info = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
            "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------- report


def trainers_of(result: dict) -> list[str]:
    """The trainers a configuration's result holds, rloo.py first."""
    return [name for name in ("rloo.py", *TRL_NAMES) if name in result]


def ratio_stats(ours: list[dict], trl: list[dict]) -> dict:
    ratios = sorted(a["episodes_per_s"] / b["episodes_per_s"] for a, b in zip(ours, trl))
    return {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}


def markdown_table(summary: dict, peaks: Optional[dict] = None) -> str:
    """The runs' medians; decoding GB/s against the machine's measured copy rate (accounting.measure_peaks)."""
    roofline = peaks and peaks["copy_gb_per_s"]
    lines = ["| configuration | trainer | episodes/s | generated tokens/s | s/update | " + " | ".join(PHASES)
             + " | forward tokens / minimum | decoding GB/s" + (f" (of {roofline:.0f} copy)" if roofline else "")
             + " | peak memory GiB |", "|---" * (8 + len(PHASES)) + "|"]
    for configuration, result in summary.items():
        for name in trainers_of(result):
            runs = result[name]
            med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            memory = med.get("peak_allocated_gib", med["peak_rss_gib"])
            lines.append(f"| {configuration} | {name} | {med['episodes_per_s']:.2f} | "
                         f"{med['generated_tokens_per_s']:.0f} | {med['seconds_per_update']:.2f} | "
                         + " | ".join(f"{med[f'{phase}_s']:.2f}" for phase in PHASES)
                         + f" | {med['forward_tokens']:,.0f} / {med['minimum_tokens']:,.0f} = "
                         f"{med['work_x_minimum']:.2f}x | {med.get('generation_gb_per_s', float('nan')):.1f} | "
                         f"{memory:.2f} |")
        for name in trainers_of(result)[1:]:
            r = result["ratio" if name == "trl" else f"ratio_{name}"]
            lines.append(f"| {configuration} | **rloo.py / {TRL_NAMES[name]}** | **{r['median']:.2f}x** (min "
                         f"{r['min']:.2f}, max {r['max']:.2f}) |" + " |" * (5 + len(PHASES)))
    return "\n".join(lines)


def main(args: Args) -> None:
    check_run_config(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_report(f"throughput_{device}", args, WRITER)  # before any run: nothing of the user's written over
    if not args.trls:
        raise plumbing.ConfigError("--trls names no TRL trainer to set rloo.py against; pass trl, trl116 or both")
    commands = {"rloo.py": [sys.executable, "rloo.py"]}
    if "trl" in args.trls:
        commands["trl"] = trainer_commands(args.trl_python, "throughput")["trl"]
    if "trl116" in args.trls:
        commands["trl116"], problem = trl116_command(args.trl116_site)
        if problem:
            sys.exit(f"throughput: {problem}, or pass --trls trl")
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    peaks = accounting.measure_peaks(torch.device(device), torch.bfloat16 if args.bf16 and device == "cuda"
                                     else torch.float32)
    start, summary, parameters = time.time(), {}, {}
    for shape in args.shapes:
        for k in args.rloo_ks:
            assets = ensure_shape_assets(shape, (REPO_ROOT / args.cache_dir).resolve(), batch // k * args.updates, args)
            configuration = f"{shape} k={k}"
            parameters[configuration] = accounting.block_parameters(pythia_config(shape))
            results = {name: [] for name in commands}
            for repeat in range(args.repeats):
                for name, command in commands.items():
                    run_dir = fresh_run_dir(REPO_ROOT / args.runs_dir / f"{shape}_k{k}_{name.replace('.', '_')}_{repeat}")
                    own = [f"--{flag}" for flag in ("compile_generation", "bf16_generation")
                           if name == "rloo.py" and getattr(args, flag)]
                    _, rss = run_trainer(command + trainer_flags(args, k, assets, run_dir) + own,
                                         run_dir.parent / f"{run_dir.name}.log", "throughput")
                    results[name].append(summarize_run(run_dir / "metrics.jsonl", args, rss))
                    print(f"{configuration} {name} repeat {repeat}: {results[name][-1]['episodes_per_s']:.2f} "
                          "episodes/s", flush=True)
            for name in trainers_of(results)[1:]:
                results["ratio" if name == "trl" else f"ratio_{name}"] = ratio_stats(results["rloo.py"], results[name])
            summary[configuration] = results
    limits = accounting.limits_table(limits_rows(summary, parameters, peaks), peaks)
    table = markdown_table(summary, peaks) + "\n\n" + limits
    print(table)
    write_report(f"throughput_{device}", args, batch, summary, table, start, WRITER, peaks)


def report_paths(name: str, args) -> list[Path]:
    """args.output_dir/<name>.json and <name>.md: a benchmark's report."""
    return [REPO_ROOT / args.output_dir / f"{name}{suffix}" for suffix in (".json", ".md")]


def check_report(name: str, args, writer: str, others: tuple[str, ...] = ()) -> None:
    """Before a benchmark runs anything: its report files (and `others`, more of its files in args.output_dir) are
    new or `writer`'s own (plumbing.check_outputs: a user's file of the same name, a link, refused in one line)."""
    plumbing.check_outputs([("--output_dir", path) for path in report_paths(name, args)]
                           + [("--output_dir", REPO_ROOT / args.output_dir / other) for other in others], [], writer)


def write_report(name: str, args, batch: int, results: dict, table: str, start: float, writer: str,
                 peaks: Optional[dict] = None, report: Optional[dict] = None) -> None:
    """args.output_dir/<name>.json (hardware and its measured limits, config, results) and <name>.md (the table),
    each marked as `writer`'s (plumbing.written_by) and never written through a link; generation_modes.py's and
    options_cost.py's too (`report`: their JSON instead of the one built here)."""
    json_path, md_path = report_paths(name, args)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    report = report or {"hardware": {**hardware(), **({"measured": peaks} if peaks else {})}, "config": asdict(args),
                        "completions_per_update": batch, "results": results, "seconds": time.time() - start}
    plumbing.write_own(json_path, json.dumps({"written_by": writer, **report}, indent=2) + "\n")
    plumbing.write_own(md_path, plumbing.marked_text(f"Hardware: {json.dumps(report['hardware'])}\n\nConfig: "
                                                     f"{json.dumps(asdict(args))}\n\n{table}\n\n", writer))
    print(f"wrote {json_path.parent}/{name}.json and .md ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    plumbing.run_tool("throughput.py", Args, main)
