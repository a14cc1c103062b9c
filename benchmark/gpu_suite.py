"""Every GPU number of benchmark/README.md, measured in the time a GPU is lent: a suite of steps run in order of
value within a budget of seconds, each call continuing where the last one stopped.

    make gpu-wheels               # beforehand, where the package registry is reachable: benchmark/gpu-wheels/ (19 MB)
    make bench-gpu                # on the GPU machine: the wheels installed offline, then this script, 480 s in all
    make bench-gpu BUDGET=1800    # another budget, in seconds, the install included

The machine needs a CUDA torch, transformers 5.x, peft and accelerate; what else rloo.py needs (tyro,
docstring_parser, typeguard, datasets, dill, multiprocess), TRL 1.16 (which runs on the machine's transformers 5.x),
and TRL 0.21 with its transformers 4.57 come from the wheel folder (Makefile: gpu-wheels, bench-gpu; installed
without byte-compiling: 5 s on 2 CPU cores). Each step writes `<results_dir>/<step>.json` when it ends, in
`benchmark/results/gpu/<the GPU's name>/` (e.g. `nvidia-h100-80gb-hbm3`: results of different GPUs never mix), and
a step whose file is there is done: the next call, or a later run on that GPU, starts at the first step not done
(delete a step's file to run it again). Before each step the suite prints its expected seconds; a step that cannot
finish in what is left of the budget is not started (one line says so: it is left for the next call), a later,
shorter one may be, and a trainer still running when the budget ends is stopped (nothing written: it runs again).
In order of value:

1. `limits`: the GPU's own ceilings, measured: a bf16 and an fp32 matmul, a device-to-device copy (accounting.py).
2. `throughput_k2_rloo`, `throughput_k2_trl116`: the headline pair, rloo.py and TRL 1.16 (benchmark/trl116_rloo.py)
   at the pythia-1b shape (random init from its config, no Hub) at TL;DR lengths (benchmark/throughput.py's prompts
   and calibrated EOS), --bf16 (fp32 master weights, bf16 autocast), k=2, 64 completions per update, 3 updates of
   which the first (warm-up) is left out: seconds and CUDA peak per phase, decoding GB/s against the copy, each
   phase's FLOP/s against the matmul.
3. `plan_memory_k2`: plan_memory.py's prediction for the same flags against each phase's measured CUDA peak.
4. `learning`: the synthetic task (benchmark/synthetic_task.py) trained on the GPU, its reward-model score from the
   first 3 updates to the last 3 (make demo's check).
5. The same at k=4 (`throughput_k4_rloo`, `throughput_k4_trl116`, `plan_memory_k4`); rloo.py with
   `--bf16_generation` (its sampling copy's mismatch/* metrics in the notes), with `--compile_generation`, and TRL
   0.21 (benchmark/trl_rloo.py), each at k=2 then k=4.
6. Where vLLM is importable (TRL 1.16's: vLLM 0.22 to 0.31), `vllm_colocate`, `vllm_colocate_sleep`,
   `vllm_colocate_trl116`: rloo_multinode.py with a colocated vLLM engine, without and with sleep mode, and TRL 1.16
   with its colocated engine (`use_vllm=True, vllm_mode="colocate"`), on a Llama of the pythia-1b shape (TRL 1.16
   colocated on GPT-NeoX fails): seconds per phase and the weight sync's, an in-process `load_weights`, no NCCL.
   `vllm_engine_nccl`: rloo_multinode.py with its engine on a second GPU, the weights broadcast over NCCL (2 GPUs
   only: a trainer and an engine cannot share one in an NCCL communicator). A step that cannot run on the machine
   (no vLLM, one GPU, no TRL) records one line saying why, at once.

Then `<results_dir>/table.md`: the markdown rows of the README's GPU section, with the GPU and the dates measured.

Expected seconds. Before a step of its kind is measured, from its shapes (`Costs`, an H100 80GB's, conservatively;
`--estimate_only` prints them with what one call would run); after, its trainer's share is scaled by the largest
measured / expected ratio of its kind (the same trainer: rloo.py's throughput runs, TRL 1.16's, TRL 0.21's, the
learning run, the vLLM runs, the in-process steps) that the results hold, and the limits step's measured matmul and
copy replace the assumed ones. The H100's, for a pythia-1b run at TL;DR lengths
(prompts padded to 512, responses 53; N ~ 1.01B parameters counting the embedding and the head as matmuls):
matmuls of a prefill, 3 forwards (policy, reference, reward) and a training pass (3 forwards' worth) over 64 x 565
token positions, 2 N x 64 x 565 x 7 ~ 510 TFLOP per update, 1.3 s at 400 TFLOP/s (40% of the ~990 dense bf16 peak);
decoding, 4 chunks of 16 x 53 steps (TRL 1.16: one of 64), each step 16 layers of eager kernel launches at 2 ms a
layer (~32 ms: eager PyTorch launches ~30 kernels a layer from Python, at ~15-30 us each, so 0.5-1 ms, taken 2-4
times over) and 8 bytes per parameter read (fp32 weights cast by autocast: read 4, write 2, read 2) plus the KV cache
at 1.5 TB/s (half of ~3.35 TB/s HBM), ~6 ms: 212 steps, ~8 s; so ~9.5 s an update. Each trainer: 25 s before its
first update (Python, torch, transformers, datasets imported from a cold disk, the CUDA context), 16 GB of fp32
checkpoints read and written at 1 GB/s (16 s), TRL's own start 15 s more; the pythia-1b models built once on the CPU
at 30 s per billion parameters (61 s).
At these costs (`python benchmark/gpu_suite.py --estimate_only --budget_s 480` prints them), one 480 s call:

| step | expected s (H100) | cumulative s |
|---|---|---|
| the wheels' install (5 s on 2 CPU cores here) and the suite's start (its imports: 10-18 s here) | 20 | 20 |
| limits | 10 | 30 |
| throughput_k2_rloo: the models built (61), the trainer (70: 25 + 16 + 3 updates of 9.5) | 130 | 160 |
| throughput_k2_trl116: the trainer (52: 3 updates of 3.5, one sampling call), TRL's start (15) | 67 | 227 |
| plan_memory_k2 | 10 | 237 |
| learning: the synthetic task built (120), the trainer (58: 250 updates of 0.13 s) | 178 | 415 |
| left for the next call: throughput_k4_rloo (70), throughput_k4_trl116 (67), plan_memory_k4 (10), at each k | | |
| `--bf16_generation` (67), `--compile_generation` (220: its compilation 150), TRL 0.21 (85); vLLM (~250) | | |

So the first call measures the first five steps with ~65 s to spare; the second, the k=4 pair to TRL 0.21; the
third, `--compile_generation`; a fourth, where vLLM is importable, the vLLM steps. Measured seconds then replace
these: a call after the first plans with its own GPU's numbers.

`--dry_run` runs every step at tiny shapes on whatever device there is (CPU in make test: tests/test_gpu_suite.py,
and make bench-gpu-dry, twice: a first call too short for the whole suite, then a second that continues), with
costs of its own (`DRY_COSTS`), into runs/gpu_suite_dry/: steps that need CUDA or vLLM record why they measured
nothing. Nothing of a dry run goes into benchmark/results/gpu.
"""

import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import torch
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmark import accounting, demo, generation_modes, synthetic_task, throughput  # noqa: E402
import plumbing  # noqa: E402

VARIANTS = {  # throughput step: (trainer, rloo.py's own flags)
    "rloo": ("rloo.py", []),
    "trl116": ("trl116", []),
    "rloo_bf16_generation": ("rloo.py", ["--bf16_generation"]),
    "rloo_compile_generation": ("rloo.py", ["--compile_generation"]),
    "trl021": ("trl", []),
}
TRL_VERSION = "0.21.0"
GPU_RESULTS = REPO_ROOT / "benchmark" / "results" / "gpu"  # tracked: a GPU's results are committed
DRY_RESULTS = REPO_ROOT / "runs" / "gpu_suite_dry"


@dataclass
class Args:
    budget_s: float = 480.0
    """seconds this call may take from --started_at (make bench-gpu: BUDGET): a step expected to take longer than
    what is left is not started, and a trainer still running at the end is stopped"""
    started_at: Optional[float] = None
    """when the call began, in Unix seconds (make bench-gpu's: before the wheels' install); None: this script's start"""
    estimate_only: bool = False
    """print each step's expected seconds and which of them this call would run, as if each took exactly its
    expected seconds; nothing runs and nothing is written"""
    results_dir: str = ""
    """where each step's JSON and table.md go and are read again by the next call; "": benchmark/results/gpu/<the
    device's name> (a dry run: runs/gpu_suite_dry/<the device's name>)"""
    runs_dir: str = "runs/gpu_suite"
    """where the trainers' runs and logs go (untracked: a pythia-1b run saves GBs), and the dry run's models"""
    dry_run: bool = False
    """tiny shapes on any device (CPU included): checks that every step starts, writes its results and resumes"""
    shape: str = "pythia-1b"
    """the Pythia shape of the throughput and plan_memory steps (benchmark/throughput.py's list)"""
    rloo_ks: tuple[int, ...] = (2, 4)
    """completions per prompt: one set of throughput runs each, the first k's headline pair before the others"""
    updates: int = 3
    """updates per throughput run, the first left out (warm-up, and --compile_generation's compilation)"""
    learning_episodes: int = 16_000
    """completions the learning step trains on (make demo's task and hyper-parameters)"""
    trl_python: str = "benchmark/.venv-trl/bin/python"
    """the Python that runs benchmark/trl_rloo.py with TRL 0.21 (make bench-env); with --trl_site, this Python"""
    trl_site: str = ""
    """a folder of TRL 0.21 and transformers 4.57 put first on PYTHONPATH for the TRL runs (make bench-gpu's, from
    the wheel folder); "" : none"""
    trl116_site: str = "benchmark/.trl116-site"
    """a folder holding TRL 1.16, put first on PYTHONPATH for benchmark/trl116_rloo.py, which runs in this Python
    (make bench-env's; make bench-gpu passes its wheel folder's site)"""


# ---------------------------------------------------------------- expected seconds


@dataclass(frozen=True)
class Costs:
    """What a step's expected seconds are computed from until the run has measured a step of its kind. The defaults
    are an H100 80GB's, on the conservative side (the module docstring's derivation); the dry run's: DRY_COSTS."""

    tflop_per_s: float = 400.0
    """the trainers' sustained matmul rate: 40% of the H100's ~990 dense bf16 TFLOP/s (once the limits step has
    run: MATMUL_SHARE of its measured bf16 matmul)"""
    gb_per_s: float = 1500.0
    """the trainers' sustained memory rate: half the H100's ~3.35 TB/s (once measured: COPY_SHARE of its copy)"""
    decode_layer_s: float = 0.002
    """a decoding step's kernel launches per layer, eager, from Python (~30 kernels: ~0.5-1 ms), x2-4"""
    update_s: float = 0.1
    """an update's cost beyond its matmuls and decoding: the other phases' launches, the optimizer, the logging"""
    process_s: float = 25.0
    """a trainer's process before its first update: Python, torch, transformers and datasets imported from a cold
    disk, the CUDA context, the prompts read (its models: disk_gb_per_s)"""
    trl_s: float = 15.0
    """TRL's own start in a TRL trainer's process: its import, its Trainer and accelerate, the dataset mapped"""
    disk_gb_per_s: float = 1.0
    """fp32 checkpoints read (policy, reference, reward model) and written (the final policy)"""
    build_s_per_gparam: float = 30.0
    """a random-init model built on the CPU (its init, the stop token's calibration) and saved, per 1e9 parameters"""
    compile_s: float = 150.0
    """--compile_generation's compilation of the decoding step (in the warm-up update)"""
    engine_s: float = 120.0
    """a vLLM engine's start: memory profiling, compilation, CUDA graphs"""
    in_process_s: float = 10.0
    """a step in the suite's own process (limits, plan_memory): CUDA's start and its own work"""
    synthetic_build_s: float = 120.0
    """the demo's synthetic task built: an SFT policy and a reward model trained on the CPU (76 s on 2 busy cores)"""


# 2 shared CPU cores at the dry run's tiny shapes: the processes' start dominates (10-40 s each, with the load)
DRY_COSTS = Costs(tflop_per_s=0.05, gb_per_s=5.0, decode_layer_s=0.001, update_s=0.2, process_s=30.0, trl_s=10.0,
                  disk_gb_per_s=0.5, compile_s=30.0, engine_s=60.0, in_process_s=5.0, synthetic_build_s=15.0)
MATMUL_SHARE = 0.4  # of the measured matmul rate, what the trainers' matmuls reach (their shapes are smaller)
COPY_SHARE = 0.5  # of the measured copy rate, what decoding's reads reach


def costs_of(args: Args, records: dict[str, dict]) -> Costs:
    """The costs of this GPU: the assumed ones, with the matmul and copy rates measured by the limits step once it
    has run (a dry run's limits, at tiny sizes on a CPU, say nothing of its trainers: DRY_COSTS)."""
    limits_record = records.get("limits", {})
    if args.dry_run or limits_record.get("status") != "measured":
        return DRY_COSTS if args.dry_run else Costs()
    peaks = limits_record["bf16"]
    return replace(Costs(), tflop_per_s=MATMUL_SHARE * peaks["matmul_tflop_per_s"],
                   gb_per_s=COPY_SHARE * peaks["copy_gb_per_s"])


def parameters_of(hidden: int, layers: int, vocab: int) -> int:
    """A decoder's parameters counted as matmul weights: 12 h^2 a block (attention 4 h^2, MLP 8 h^2), the embedding
    and the head (the embedding a lookup: counted, to be on the safe side)."""
    return layers * 12 * hidden**2 + 2 * vocab * hidden


def trainer_seconds(costs: Costs, *, hidden: int, layers: int, vocab: int, batch: int, rows: int, prompt_length: int,
                    response_length: int, updates: int, weight_bytes: int = 8) -> float:
    """A trainer process's expected seconds from its shapes: its start, its three fp32 models read and its policy
    written, then per update the decoding (response_length steps for each `rows` completions sampled at once; a step
    costs its layers' kernel launches and reads the weights, `weight_bytes` a parameter, and the KV cache), the
    matmuls of a prefill, 3 forwards (policy, reference, reward) and a training pass (3 forwards' worth) over every
    completion's padded prompt and response (no prompt shared: an upper bound for rloo.py), and its fixed cost."""
    parameters = parameters_of(hidden, layers, vocab)
    length = prompt_length + response_length
    kv_bytes = rows * length * layers * 2 * hidden * 2  # keys and values in bf16
    decode_step_s = layers * costs.decode_layer_s + (weight_bytes * parameters + kv_bytes) / (costs.gb_per_s * 1e9)
    matmul_s = 2 * parameters * batch * length * 7 / (costs.tflop_per_s * 1e12)
    update_s = response_length * math.ceil(batch / rows) * decode_step_s + matmul_s + costs.update_s
    load_s = 4 * 4 * parameters / (costs.disk_gb_per_s * 1e9)
    return costs.process_s + load_s + updates * update_s


def expected_seconds(step: "Step", args: Args, costs: Costs, records: dict[str, dict],
                     built: bool = False) -> tuple[float, float, str]:
    """A step's expected seconds, its trainer's share from the shapes, and where the total comes from: the shapes,
    or the shapes with the trainer's share scaled by the largest measured / expected ratio of the steps of its kind
    done so far (in this call or an earlier one). `built`: its models are taken as built (--estimate_only, after a
    step that builds the same)."""
    setup_s, trainer_s = step.expected(args, costs)
    setup_s = 0.0 if built else setup_s
    ratios = {name: record.get("wall_seconds", record["seconds"]) / record["expected"]["trainer_s"]
              for name, record in records.items() if record.get("kind") == step.kind and "expected" in record}
    if not ratios:
        return setup_s + trainer_s, trainer_s, "from the shapes"
    name, ratio = max(ratios.items(), key=lambda item: item[1])
    return setup_s + trainer_s * ratio, trainer_s, f"from the shapes, x{ratio:.2f} as {name} measured"


# ---------------------------------------------------------------- the steps


@dataclass(frozen=True)
class Step:
    """One step of the suite: `run(args, results, deadline)` measures (a trainer still running at `deadline`, by
    time.time(), is stopped) and returns what its JSON records; `expected(args, costs)` its seconds from its shapes,
    (building its models, once; its trainer's process or its own work); `problem(args)` why it cannot run on this
    machine, or None; `needs` the steps whose results it reads."""

    run: Callable[[Args, Path, float], dict]
    expected: Callable[[Args, Costs], tuple[float, float]]
    kind: str  # steps of one kind (the same trainer on the same shapes) scale each other's expected seconds
    problem: Callable[[Args], Optional[str]] = lambda args: None
    needs: tuple[str, ...] = ()
    builds: str = ""  # the models it builds if they are not there yet, shared with the steps that name the same


def run_config(args: Args, k: int) -> throughput.RunConfig:
    """The throughput steps' configuration: the pythia-1b shape at TL;DR lengths, 64 completions per update, bf16
    autocast over fp32 master weights; on-policy (1 epoch, 1 minibatch). Dry run: pythia-14m, 32 + 8 tokens."""
    runs = REPO_ROOT / args.runs_dir
    if args.dry_run:
        return throughput.RunConfig(
            shapes=("pythia-14m",), updates=2, warmup_updates=1, lengths="tldr", prompt_length=32, response_length=8,
            mean_response_length=None, per_device_train_batch_size=4, gradient_accumulation_steps=1,
            num_mini_batches=1, num_ppo_epochs=1, local_rollout_forward_batch_size=4, bf16=True,
            cache_dir=str(runs / "cache"), runs_dir=str(runs))
    return throughput.RunConfig(
        shapes=(args.shape,), updates=args.updates, warmup_updates=1, lengths="tldr", prompt_length=512,
        response_length=53, mean_response_length=34.0, per_device_train_batch_size=16, gradient_accumulation_steps=4,
        num_mini_batches=1, num_ppo_epochs=1, local_rollout_forward_batch_size=16, bf16=True,
        cache_dir=".cache/throughput", runs_dir=str(runs))


def batch_of(config) -> int:
    return config.per_device_train_batch_size * config.gradient_accumulation_steps * config.num_mini_batches


def read_rows(metrics_path: Path, warmup: int) -> list[dict]:
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if "time/update" in row][warmup:]


def trl_problem(args: Args) -> str | None:
    """Why TRL 0.21 cannot run here (one line), or None: the trl that Python would import, by its metadata
    (importing TRL takes seconds, and the run itself imports it)."""
    python = REPO_ROOT / args.trl_python
    if not python.exists():
        return f"TRL not importable: no Python at {args.trl_python} (make bench-env, or make bench-gpu's wheels)"
    env = {**os.environ, **({"PYTHONPATH": str(REPO_ROOT / args.trl_site)} if args.trl_site else {})}
    check = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('trl'))"],
                           capture_output=True, text=True, env=env)
    if check.returncode != 0:
        return f"TRL not importable with {args.trl_python}: {(check.stderr.strip().splitlines() or ['?'])[-1]}"
    if check.stdout.strip() != TRL_VERSION:
        return f"TRL not importable at {TRL_VERSION}: {args.trl_python} has trl {check.stdout.strip()}"
    return None


def trainer_problem(args: Args, trainer: str) -> str | None:
    if trainer == "trl":
        return trl_problem(args)
    return throughput.trl116_command(args.trl116_site)[1] if trainer == "trl116" else None


def trainer_command(args: Args, trainer: str) -> list[str]:
    if trainer == "trl":
        site = ["env", f"PYTHONPATH={REPO_ROOT / args.trl_site}"] if args.trl_site else []
        return site + [str(REPO_ROOT / args.trl_python), "benchmark/trl_rloo.py"]
    return throughput.trl116_command(args.trl116_site)[0] if trainer == "trl116" else [sys.executable, "rloo.py"]


def limits(args: Args, results: Path, deadline: float) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = {"matmul_size": 256, "copy_bytes": 2**24, "repeats": 2} if args.dry_run else {}
    return {"status": "measured", "device": device_name(),
            "bf16": accounting.measure_peaks(device, torch.bfloat16, **sizes),
            "fp32": accounting.measure_peaks(device, torch.float32, **sizes)}


def in_process_seconds(args: Args, costs: Costs) -> tuple[float, float]:
    return 0.0, costs.in_process_s


def throughput_step(k: int, variant: str) -> Step:
    trainer, own = VARIANTS[variant]

    def expected(args: Args, costs: Costs) -> tuple[float, float]:
        config = run_config(args, k)
        hidden, layers, _ = throughput.PYTHIA_SHAPES[config.shapes[0]]
        batch = batch_of(config)
        paths = throughput.shape_asset_paths(config.shapes[0], (REPO_ROOT / config.cache_dir).resolve(),
                                             batch // k * config.updates, config)
        built = all((paths[name] / "config.json").exists() for name in ("policy", "reward_model"))
        setup_s = 0.0 if built else costs.build_s_per_gparam * 2 * parameters_of(
            hidden, layers, throughput.PYTHIA_VOCAB) / 1e9
        run_s = trainer_seconds(
            costs, hidden=hidden, layers=layers, vocab=throughput.PYTHIA_VOCAB, batch=batch,
            rows=batch if trainer == "trl116" else config.local_rollout_forward_batch_size,  # TRL 1.16: one call
            prompt_length=config.prompt_length, response_length=config.response_length, updates=config.updates,
            weight_bytes=2 if "--bf16_generation" in own else 8)  # a bf16 copy: no autocast casts
        extra_s = (costs.trl_s if trainer != "rloo.py" else 0.0) + (
            costs.compile_s if "--compile_generation" in own else 0.0)
        return setup_s, run_s + extra_s

    def run(args: Args, results: Path, deadline: float) -> dict:
        config = run_config(args, k)
        shape = config.shapes[0]
        assets = throughput.ensure_shape_assets(shape, (REPO_ROOT / config.cache_dir).resolve(),
                                                batch_of(config) // k * config.updates, config)
        run_dir = throughput.fresh_run_dir(REPO_ROOT / config.runs_dir / f"throughput_k{k}_{variant}")
        full = trainer_command(args, trainer) + throughput.trainer_flags(config, k, assets, run_dir) + own
        try:
            seconds, rss = throughput.run_trainer(full, run_dir.parent / f"{run_dir.name}.log", "gpu_suite",
                                                  timeout=deadline - time.time())
        finally:  # measured from metrics.jsonl: the weights only fill the disk
            throughput.drop_weights(run_dir)
        summary = throughput.summarize_run(run_dir / "metrics.jsonl", config, rss)
        peaks = json.loads((results / "limits.json").read_text())["bf16" if config.bf16 else "fp32"]
        summary.update(accounting.achieved(summary, accounting.block_parameters(throughput.pythia_config(shape)),
                                           peaks))
        rows = read_rows(run_dir / "metrics.jsonl", config.warmup_updates)
        mismatch = {key: statistics.mean(row[key] for row in rows if key in row)
                    for key in sorted({key for row in rows for key in row if key.startswith("mismatch/")})}
        return {"status": "measured", "command": full, "wall_seconds": seconds, "shape": shape, "k": k,
                "trainer": trainer, "result": summary, "mismatch": mismatch}

    return Step(run, expected, f"throughput {trainer}", problem=lambda args: trainer_problem(args, trainer),
                needs=("limits",), builds="the throughput shape's models")


def plan_memory_step(k: int) -> Step:
    def run(args: Args, results: Path, deadline: float) -> dict:
        import plan_memory
        import plumbing
        import rloo

        measured = json.loads((results / f"throughput_k{k}_rloo.json").read_text())
        flags = [s for s in measured["command"][2:] if s != "--bf16_generation"]
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
        plan_args = plumbing.parse_args(plan_memory.PlanArgs, flags + ["--world_size", "1", "--gpu_gib", str(gpu_gib)],
                                        prog="plan_memory.py")
        plumbing.validate_args(plan_args)
        rloo.compute_batch_sizes(plan_args, 1)
        policy = plan_memory.model_shape(plan_args.model_name_or_path, False, False)
        reward = plan_memory.model_shape(plan_args.reward_model_path, True, False)
        groups = {name: sum(parts.values()) / 2**30
                  for name, parts in plan_memory.plan(plan_args, policy, reward).items()}
        predicted = {"rollout": groups["resident"] + groups["rollout"],
                     "training": groups["resident"] + groups["training"]}
        result = measured["result"]
        phases = {phase: {"predicted_gib": predicted["training" if phase == "training" else "rollout"],
                          "measured_gib": result.get(f"{phase}_peak_gib")} for phase in throughput.PHASES}
        return {"status": "measured" if torch.cuda.is_available() else "predicted only: no CUDA peaks on this device",
                "gpu_gib": gpu_gib, "groups_gib": groups, "phases": phases}

    return Step(run, in_process_seconds, "in_process", needs=(f"throughput_k{k}_rloo",))


TRL116_VLLM = ("0.22.0", "0.31.0")  # the vLLM releases TRL 1.16 supports (its import_utils); 0.32's CPU build
# fails in TRL's colocated weight sync (vLLM repacks the linear weights, which TRL's load_weights then cannot find)


def vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm")


VLLM_STEPS = {  # name -> how its weight sync moves the weights, as the table says it
    "vllm_colocate": "in-process, into the engine in the training process (no NCCL)",
    "vllm_colocate_sleep": "in-process, waking the engine's weights first (no NCCL)",
    "vllm_colocate_trl116": "in-process, TRL 1.16's load_weights per parameter (no NCCL)",
    "vllm_engine_nccl": "NCCL broadcast to an engine on a second GPU",
}


def vllm_problem(name: str, args: Args) -> str | None:
    """Why a vLLM step cannot run here: no vLLM; sleep mode without CUDA; the NCCL weight sync on one GPU (a trainer
    and an engine cannot share a GPU in one communicator); TRL 1.16 missing or outside its vLLM range."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM not importable"
    if name == "vllm_colocate_sleep" and not torch.cuda.is_available():
        return "sleep mode needs CUDA"
    if name == "vllm_engine_nccl" and torch.cuda.device_count() < 2:
        return (f"a weight sync over NCCL needs 2 GPUs (the trainer's, the engine's); this machine has "
                f"{torch.cuda.device_count()}: the colocated rows' sync is in-process")
    if name == "vllm_colocate_trl116":
        problem = throughput.trl116_command(args.trl116_site)[1]
        if problem:
            return problem
        low, high = (Version(v) for v in TRL116_VLLM)
        if not low <= Version(Version(vllm_version()).base_version) <= high:
            return (f"TRL 1.16 supports vLLM {TRL116_VLLM[0]} to {TRL116_VLLM[1]}; this machine has vLLM "
                    f"{vllm_version()}")
    return None


def vllm_modes(args: Args) -> generation_modes.Args:
    """The vLLM steps' configuration: the throughput steps' at k=2, on a Llama of the same shape (vLLM colocates
    it)."""
    config = run_config(args, 2)
    hidden, layers, heads = throughput.PYTHIA_SHAPES[config.shapes[0]]
    shared = {f: getattr(config, f) for f in throughput.RunConfig.__dataclass_fields__}
    return generation_modes.Args(**{
        **shared, "rloo_k": 2, "hidden_size": hidden, "layers": layers, "heads": heads,
        "vllm_enable_sleep_mode": False, "gpu_memory_utilization": 0.3,
        "mean_response_length": config.mean_response_length or float(config.response_length),
        "cache_dir": str(Path(config.cache_dir).parent / "generation_modes")})


def vllm_step(name: str) -> Step:
    """rloo_multinode.py with a colocated vLLM engine (without and with sleep mode), TRL 1.16 with its colocated
    engine, and rloo_multinode.py with an engine in a process of its own on a second GPU, its weights sent over NCCL."""
    def expected(args: Args, costs: Costs) -> tuple[float, float]:
        modes = vllm_modes(args)
        setup_s = costs.build_s_per_gparam * 2 * parameters_of(
            modes.hidden_size, modes.layers, throughput.PYTHIA_VOCAB) / 1e9  # its Llama: counted as if to build
        run_s = trainer_seconds(
            costs, hidden=modes.hidden_size, layers=modes.layers, vocab=throughput.PYTHIA_VOCAB,
            batch=batch_of(modes), rows=modes.local_rollout_forward_batch_size, prompt_length=modes.prompt_length,
            response_length=modes.response_length, updates=modes.updates)
        return setup_s, run_s + costs.engine_s + (costs.trl_s if name == "vllm_colocate_trl116" else 0.0)

    def run(args: Args, results: Path, deadline: float) -> dict:
        modes = replace(vllm_modes(args), vllm_enable_sleep_mode=name == "vllm_colocate_sleep")
        assets = generation_modes.ensure_assets(modes, batch_of(modes) // 2 * modes.updates)
        run_dir = throughput.fresh_run_dir(REPO_ROOT / modes.runs_dir / name)
        if name == "vllm_colocate_trl116":
            command = throughput.trl116_command(args.trl116_site)[0] + ["--use_vllm"]
        elif name == "vllm_engine_nccl":  # the trainer on GPU 0, the engine rank 0 starts on GPU 1
            command = [sys.executable, "rloo_multinode.py", "--num_engines", "1", "--engine_devices", "1",
                       "--vllm_gpu_memory_utilization", "0.5"]
        else:
            command = generation_modes.mode_command("colocate", modes)
        full = command + throughput.trainer_flags(modes, 2, assets, run_dir)
        try:
            seconds, rss = throughput.run_trainer(full, run_dir.parent / f"{run_dir.name}.log", "gpu_suite",
                                                  timeout=deadline - time.time())
        finally:
            throughput.drop_weights(run_dir)
        summary = throughput.summarize_run(run_dir / "metrics.jsonl", modes, rss)
        rows = read_rows(run_dir / "metrics.jsonl", modes.warmup_updates)
        summary["weight_sync_s"] = statistics.mean(row.get("time/weight_sync", 0.0) for row in rows)
        return {"status": "measured", "command": full, "wall_seconds": seconds, "weight_sync": VLLM_STEPS[name],
                "result": summary}

    return Step(run, expected, "vllm trl116" if name == "vllm_colocate_trl116" else "vllm",
                problem=lambda args: vllm_problem(name, args))


def learning_cache(args: Args) -> Path:
    """Where the synthetic task is built: make demo's (reused), or the dry run's own, weaker one."""
    return REPO_ROOT / args.runs_dir / "cache" / "synthetic_task" if args.dry_run else REPO_ROOT / ".cache/rloo_demo"


def learning_command(args: Args) -> list[str]:
    """The learning step's rloo.py command: make demo's, for fewer episodes."""
    assets = {name: str(path) for name, path in synthetic_task.asset_paths(learning_cache(args)).items()}
    output_dir = (REPO_ROOT / args.runs_dir).resolve() / "learning"
    episodes = 128 if args.dry_run else args.learning_episodes
    command = demo.rloo_command(demo.Args(output_dir=str(output_dir), total_episodes=episodes), assets)
    command += ["--bf16"] if torch.cuda.is_available() else []
    return command + (["--num_sample_generations", "0"] if args.dry_run else [])


def flag_value(command: list[str], flag: str) -> int:
    return int(command[command.index(flag) + 1])


def learning_seconds(args: Args, costs: Costs) -> tuple[float, float]:
    command = learning_command(args)
    config = synthetic_task.tiny_config(synthetic_task.build_tokenizer())
    batch = (flag_value(command, "--per_device_train_batch_size") * flag_value(command, "--gradient_accumulation_steps")
             * flag_value(command, "--num_mini_batches"))
    run_s = trainer_seconds(
        costs, hidden=config.hidden_size, layers=config.num_hidden_layers, vocab=config.vocab_size, batch=batch,
        rows=flag_value(command, "--local_rollout_forward_batch_size"),
        prompt_length=flag_value(command, "--max_prompt_length"),
        response_length=flag_value(command, "--response_length"),
        updates=flag_value(command, "--total_episodes") // batch)
    built = synthetic_task.asset_paths(learning_cache(args))["done"].exists()
    return (0.0 if built else costs.synthetic_build_s), run_s


def learning(args: Args, results: Path, deadline: float) -> dict:
    paths = synthetic_task.asset_paths(learning_cache(args))
    if args.dry_run and not paths["done"].exists():  # a weaker task built in seconds: the dry run checks the step
        synthetic_task.build_assets(paths, policy_steps=2, reward_steps=2)
    demo.ensure_assets(learning_cache(args))
    command = learning_command(args)
    output_dir = Path(command[command.index("--output_dir") + 1])
    log = output_dir.parent / "learning.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    seconds, _ = throughput.run_trainer(command, log, "gpu_suite", timeout=deadline - time.time())
    scores = [row["objective/scores"] for row in read_rows(output_dir / "metrics.jsonl", 0)]
    first, last = statistics.mean(scores[:3]), statistics.mean(scores[-3:])
    return {"status": "measured", "command": command, "wall_seconds": seconds, "updates": len(scores),
            "score_first_3": first, "score_last_3": last, "learns": last - first >= demo.MIN_RISE}


def steps(args: Args) -> dict[str, Step]:
    """The suite in order of value (name -> Step): the headline pair, its memory check and the learning check at the
    first k before anything else, so that a short first call measures them."""
    def pair(k: int) -> dict[str, Step]:
        return {f"throughput_k{k}_rloo": throughput_step(k, "rloo"),
                f"throughput_k{k}_trl116": throughput_step(k, "trl116"), f"plan_memory_k{k}": plan_memory_step(k)}

    first, *others = args.rloo_ks
    out = {"limits": Step(limits, in_process_seconds, "in_process"), **pair(first),
           "learning": Step(learning, learning_seconds, "learning")}
    for k in others:
        out.update(pair(k))
    for variant in ("rloo_bf16_generation", "rloo_compile_generation", "trl021"):
        out.update({f"throughput_k{k}_{variant}": throughput_step(k, variant) for k in args.rloo_ks})
    out.update({name: vllm_step(name) for name in VLLM_STEPS})
    return out


# ---------------------------------------------------------------- results


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else throughput.cpu_model()


def slug(name: str) -> str:
    """A device's name as a folder's: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def results_dir_of(args: Args) -> Path:
    """--results_dir, or a folder named by the device under benchmark/results/gpu (a dry run: runs/gpu_suite_dry):
    each GPU's results apart, and a later call on the same GPU reads what the earlier ones wrote."""
    if args.results_dir:
        return (REPO_ROOT / args.results_dir).resolve()
    return (DRY_RESULTS if args.dry_run else GPU_RESULTS) / slug(device_name())


def read_records(results: Path) -> dict[str, dict]:
    """The steps done: {name: its JSON object}. A file there that is not one (cut short, edited) is one line naming
    it: its step runs again once it is removed."""
    records = {}
    for path in sorted(results.glob("*.json")):
        try:
            records[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
            problem = f"unreadable ({e.strerror or e})" if isinstance(e, OSError) else \
                f"not JSON ({plumbing.first_line(e)})"
        else:
            if isinstance(records[path.stem], dict):
                continue
            problem = f"a JSON {type(records[path.stem]).__name__}, not a step's object"
        raise plumbing.ConfigError(f"{path} is {problem}: remove it, and its step runs again at the next call")
    return records


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table(args: Args, results: Path) -> str:
    """The README's GPU rows from the steps' JSON files, with the device and the dates they were measured."""
    order = list(steps(args))  # the suite's order; files of other steps after them
    read = dict(sorted(read_records(results).items(), key=lambda item: (
        order.index(item[0]) if item[0] in order else len(order), item[0])))
    device = read.get("limits", {}).get("device", "?")
    dates = sorted(step["finished_at"][:10] for step in read.values() if "finished_at" in step)
    when = f", measured {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "") if dates else ""
    done = sum(name in read for name in order)
    lines = [f"Device: {device}{when} ({done} of {len(order)} steps done). " + (
        "Limits measured here: bf16 matmul {bf16[matmul_tflop_per_s]:.4g} TFLOP/s, fp32 {fp32[matmul_tflop_per_s]:.4g} "
        "TFLOP/s, copy {bf16[copy_gb_per_s]:.1f} GB/s (read + write).".format(**read["limits"])
        if "limits" in read else ""), "",
        "| step | s/update | generation | policy forward | reference | scoring | training | decoding GB/s (% of copy) "
        "| training TFLOP/s (% of bf16 matmul) | peak GiB: generation / training | plan_memory.py GiB: rollout / "
        "training | notes |", "|---" * 12 + "|"]
    for name, step in read.items():
        if not name.startswith(("throughput_", "vllm_")):
            continue
        if not step["status"].startswith("measured"):
            lines.append(f"| {name} | {step['status']} |" + " |" * 10)
            continue
        r = step["result"]
        plan = read.get(f"plan_memory_k{step.get('k')}", {}).get("phases", {}) if step.get("trainer") == "rloo.py" \
            and name.endswith("_rloo") else {}
        notes = ", ".join(f"{key.removeprefix('mismatch/')} {value:.3g}"
                          for key, value in step.get("mismatch", {}).items())
        if "weight_sync_s" in r:
            notes = f"weight sync {r['weight_sync_s']:.3f} s: {step['weight_sync']}"
        decoding = (f"{r['generation_gb_per_s']:.1f} ({100 * r['decoding_of_copy']:.0f}%)"
                    if "decoding_of_copy" in r else fmt(r.get("generation_gb_per_s"), ".1f"))
        training = (f"{r['training_tflop_per_s']:.3g} ({100 * r['training_of_matmul']:.0f}%)"
                    if "training_of_matmul" in r else "-")
        lines.append(
            f"| {name} | {r['seconds_per_update']:.2f} | {r['generation_s']:.2f} | {r['policy_forward_s']:.2f} | "
            f"{r['reference_forward_s']:.2f} | "
            f"{r['scoring_s']:.2f} | {r['training_s']:.2f} | {decoding} | {training} | "
            f"{fmt(r.get('generation_peak_gib'))} / {fmt(r.get('training_peak_gib'))} | "
            f"{fmt(plan.get('generation', {}).get('predicted_gib'))} / "
            f"{fmt(plan.get('training', {}).get('predicted_gib'))} | {notes} |")
    for k in args.rloo_ks:
        for variant, trl_name in (("trl116", "TRL 1.16"), ("trl021", "TRL 0.21")):
            ours, trl = read.get(f"throughput_k{k}_rloo"), read.get(f"throughput_k{k}_{variant}")
            if ours and trl and ours["status"] == trl["status"] == "measured":
                ratio = ours["result"]["episodes_per_s"] / trl["result"]["episodes_per_s"]
                lines.append(f"\nk={k}: rloo.py / {trl_name} episodes/s: **{ratio:.2f}x**")
    ours, trl = read.get("vllm_colocate"), read.get("vllm_colocate_trl116")
    if ours and trl and ours["status"] == trl["status"] == "measured":
        ratio = ours["result"]["episodes_per_s"] / trl["result"]["episodes_per_s"]
        lines.append(f"\nk=2, colocated vLLM: rloo_multinode.py / TRL 1.16 episodes/s: **{ratio:.2f}x**")
    if "learning" in read:
        step = read["learning"]
        lines.append(f"\nlearning (synthetic task, {step['updates']} updates): reward-model score "
                     f"{step['score_first_3']:.3f} (first 3 updates) -> {step['score_last_3']:.3f} (last 3): "
                     + ("learns" if step["learns"] else f"rose less than {demo.MIN_RISE}"))
    text = "\n".join(lines) + "\n"
    plumbing.write_own(results / "table.md", plumbing.marked_text(text + "\n", WRITER))  # never through a link
    return text


# ---------------------------------------------------------------- the call


def check_args(args: Args, results: Path, now: float) -> None:
    """Bad input refused in one line (a ConfigError: exit status 2), before anything is written."""
    if args.shape not in throughput.PYTHIA_SHAPES:
        raise plumbing.ConfigError(f"unknown shape {args.shape}; choose from {list(throughput.PYTHIA_SHAPES)}")
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        raise plumbing.ConfigError(f"--budget_s {args.budget_s} is not a positive number of seconds: pass e.g. 480")
    if args.started_at is not None and not (math.isfinite(args.started_at) and args.started_at <= now):
        raise plumbing.ConfigError(f"--started_at {args.started_at} is not a time in Unix seconds before now "
                                   f"({now:.0f}): pass when the call began (date +%s), or leave it out for this "
                                   "script's start")
    if not args.rloo_ks:
        raise plumbing.ConfigError("--rloo_ks is empty: pass at least one k, e.g. 2")
    if not torch.cuda.is_available() and not (args.dry_run or args.estimate_only):
        raise plumbing.ConfigError("no CUDA device; --dry_run runs the suite at tiny shapes on this machine, "
                                   "--estimate_only prints what a call would run")
    if args.dry_run and results.is_relative_to(GPU_RESULTS):
        raise plumbing.ConfigError("a dry run measures no GPU, and benchmark/results/gpu holds only GPUs' results: "
                                   "pass a --results_dir outside it")
    table_md = results / "table.md"  # the suite's own (its mark), or none: a user's table.md is never replaced
    if not args.estimate_only and (table_md.is_symlink() or table_md.exists()) and (
            table_md.is_symlink() or plumbing.written_by(table_md) != WRITER):
        raise plumbing.ConfigError(f"{plumbing.inert(table_md, 200)} exists and the suite did not write it: it "
                                   "would be replaced; move it, or pass another --results_dir")


WRITER = "benchmark/gpu_suite.py"  # the mark of its table.md (plumbing.marked_text), which it alone replaces


WRAP_UP_S = 5.0  # kept from the budget for what follows the last step (the table, the exit)


def main(args: Args, clock: Callable[[], float] = time.time) -> None:
    """Each step not done, in order, if its expected seconds fit in what is left of the budget; then the table.
    `clock` gives the time in seconds: time.time, or a test's own."""
    now = clock()
    started_at = now if args.started_at is None else args.started_at
    deadline = started_at + args.budget_s - WRAP_UP_S  # the steps' end: the table, then the exit, within the budget
    results = results_dir_of(args)
    check_args(args, results, now)
    args = replace(args, results_dir=str(results))
    records = read_records(results) if results.exists() else {}
    failed, left = [], []
    simulated_s, simulated_builds = 0.0, set()  # --estimate_only: the seconds its steps would have taken, built
    for name, step in steps(args).items():
        if name in records:
            print(f"== {name}: done earlier ({name}.json), skipped", flush=True)
            continue
        problem = step.problem(args)
        if problem:  # recorded at once: no time spent
            save(args, results, records, name, {"status": f"skipped: {problem}"})
            continue
        missing = [need for need in step.needs if need not in records]
        if missing:
            print(f"== {name}: not started: it reads {', '.join(missing)}, not done yet: left for the next call")
            left.append(name)
            continue
        expected, trainer_s, source = expected_seconds(step, args, costs_of(args, records), records,
                                                       built=bool(step.builds) and step.builds in simulated_builds)
        seconds_left = deadline - clock() - simulated_s
        if expected > seconds_left:
            print(f"== {name}: not started: expected ~{expected:.0f} s ({source}), {max(seconds_left, 0):.0f} s left "
                  "of the budget: left for the next call", flush=True)
            left.append(name)
            continue
        print(f"== {name}: expected ~{expected:.0f} s ({source}), {seconds_left:.0f} s left", flush=True)
        if args.estimate_only:
            simulated_s += expected
            simulated_builds.add(step.builds)  # built once, by the first step that needs them
            records[name] = {"status": "estimated"}
            continue
        start = clock()
        try:
            measured = step.run(args, results, deadline)
        except (Exception, SystemExit) as e:  # the other steps still run (GPU time is short); this one runs again
            # at the next start, as nothing is written for it
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            if clock() >= deadline:  # its trainer was stopped at the budget's end: its estimate was too short
                print(f"== {name}: stopped at the budget's end, nothing written, it runs first next time: {why}")
                left.append(name)
            else:
                failed.append(name)
                print(f"== {name}: FAILED, nothing written, it runs again next time: {why}", flush=True)
            continue
        save(args, results, records, name, {**measured, "kind": step.kind, "seconds": clock() - start,
                                            "expected": {"seconds": expected, "trainer_s": trainer_s, "from": source}})
    used = clock() + simulated_s - started_at
    print((f"== {len(left)} step(s) left for the next call: {', '.join(left)}" if left else "== every step done")
          + f" ({used:.0f} s of the {args.budget_s:.0f} s budget used{', as estimated' if args.estimate_only else ''})")
    if not args.estimate_only and results.exists():
        print(table(args, results) + f"\nresults: {results}")
    if failed:
        sys.exit(f"gpu_suite: {len(failed)} step(s) failed: {', '.join(failed)} (their output above; run again to "
                 "retry them, the others are skipped)")


def save(args: Args, results: Path, records: dict[str, dict], name: str, record: dict) -> None:
    """A step's JSON, dated: it is done, and the next call skips it (--estimate_only: only said)."""
    if not args.estimate_only:
        record = {"step": name, **record, "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        results.mkdir(parents=True, exist_ok=True)
        plumbing.write_own(results / f"{name}.json", json.dumps(record, indent=2) + "\n")
        records[name] = record
    print(f"== {name}: {record['status']}" + (f" ({record['seconds']:.0f} s)" if "seconds" in record else ""),
          flush=True)


if __name__ == "__main__":
    import plumbing

    plumbing.run_tool("gpu_suite.py", Args, main)
