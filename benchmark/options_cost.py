"""What rloo.py's memory and speed options cost on this machine: runs of each option set on a random-init Pythia
shape, in the configuration of benchmark/throughput.py, reporting seconds per phase and peak memory (CUDA max
allocated, and the process's peak RSS), medians over interleaved repeats.

    python benchmark/options_cost.py                              # pythia-14m, CPU: the README's table
    python benchmark/options_cost.py --shapes pythia-1b --bf16    # on a GPU (add --prompt_length 512)

The FSDP sets run under a one-process torchrun (what a one-GPU user launches). On CPU, --offload moves nothing
(everything already lives in host memory): its row measures the bookkeeping only.
"""

import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import plumbing  # noqa: E402
from benchmark.throughput import (  # noqa: E402
    PHASES, REPO_ROOT, RunConfig, check_report, check_run_config, ensure_shape_assets, fresh_run_dir, hardware,
    run_trainer, summarize_run, trainer_flags, write_report,
)

WRITER = "benchmark/options_cost.py"  # the mark of its reports: a path that exists is replaced only if it has it

OPTION_SETS = {  # name: (launched under a 1-process torchrun, rloo.py flags)
    "baseline": (False, []),
    "gradient_checkpointing": (False, ["--gradient_checkpointing"]),
    "bf16": (False, ["--bf16"]),
    "compile_generation": (False, ["--compile_generation"]),
    "fsdp": (True, ["--fsdp"]),
    "fsdp_offload": (True, ["--fsdp", "--offload"]),
    "lora": (False, ["--use_peft"]),
}


@dataclass
class Args(RunConfig):
    rloo_k: int = 2
    """completions per prompt"""
    options: tuple[str, ...] = tuple(OPTION_SETS)
    """option sets to run, from: baseline, gradient_checkpointing, bf16, compile_generation, fsdp, fsdp_offload, lora"""
    repeats: int = 2
    """rounds over the option sets (interleaved); each figure is the median over them"""
    output_name: str = "options_cost"
    """results go to output_dir/<output_name>_<device>.json and .md"""


def main(args: Args) -> None:
    check_run_config(args)
    unknown = [o for o in args.options if o not in OPTION_SETS]
    if unknown:
        raise plumbing.ConfigError(f"--options: unknown option set(s) {unknown}; choose from {list(OPTION_SETS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_report(f"{args.output_name}_{device}", args, WRITER)  # before any run: nothing of the user's written over
    start = time.time()
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # torchrun would otherwise set 1
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    runs = {}
    for shape in args.shapes:
        assets = ensure_shape_assets(shape, (REPO_ROOT / args.cache_dir).resolve(), batch // args.rloo_k * args.updates,
                                     args)
        for repeat in range(args.repeats):
            for index, name in enumerate(args.options):
                torchrun, flags = OPTION_SETS[name]
                launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] \
                    if torchrun else [sys.executable]
                run_dir = fresh_run_dir(REPO_ROOT / args.runs_dir / f"options_{shape}_{index}_{repeat}")
                _, rss = run_trainer(launcher + ["rloo.py"] + trainer_flags(args, args.rloo_k, assets, run_dir) + flags,
                                     run_dir.parent / f"{run_dir.name}.log", "options_cost")
                run = summarize_run(run_dir / "metrics.jsonl", args, rss)
                runs.setdefault(f"{shape} {name}", []).append(run)
                print(f"{shape} {name} repeat {repeat}: {run['seconds_per_update']:.2f} s/update", flush=True)
    results = {key: {field: statistics.median(run[field] for run in repeats) for field in repeats[0]}
               for key, repeats in runs.items()}
    columns = ["seconds_per_update", *[f"{p}_s" for p in PHASES], "peak_rss_gib", "peak_allocated_gib"]
    table = "\n".join(["| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"] + [
        f"| {run} | " + " | ".join(f"{r[c]:.2f}" if c in r else "-" for c in columns) + " |"
        for run, r in results.items()])
    print(table)
    report = {"hardware": hardware(), "config": asdict(args), "results": results, "runs": runs}
    write_report(f"{args.output_name}_{device}", args, batch, results, table, start, WRITER, report=report)


if __name__ == "__main__":
    plumbing.run_tool("options_cost.py", Args, main)
