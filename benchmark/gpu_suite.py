"""Every GPU number of benchmark/README.md from one command, on one GPU machine with no network.

    make gpu-wheels    # beforehand, where the package registry is reachable: benchmark/gpu-wheels/ (~19 MB)
    make bench-gpu     # on the GPU machine: installs those wheels offline, then runs this script

The machine needs a CUDA torch, transformers 5.x, peft and accelerate; what else rloo.py needs (tyro,
docstring_parser, typeguard, datasets, dill, multiprocess), TRL 1.16 (which runs on the machine's transformers 5.x),
and TRL 0.21 with its transformers 4.57 come from the wheel folder (Makefile: gpu-wheels, bench-gpu). Each step takes
a few minutes at the GPU shapes (under 10) and writes `<results_dir>/<step>.json` when it ends; a step whose file
exists is skipped, so a run cut short resumes where it stopped (delete a step's file to run it again). In order:

- `limits`: the GPU's own ceilings, measured: a bf16 and an fp32 matmul, a device-to-device copy (accounting.py).
- `throughput_k{2,4}_{rloo,trl116,rloo_bf16_generation,trl021,rloo_compile_generation}`: the pythia-1b shape
  (random init from its config, no Hub) at TL;DR lengths (benchmark/throughput.py's prompts and calibrated EOS),
  --bf16 (fp32 master weights, bf16 autocast); rloo.py plain, with --bf16_generation, with --compile_generation,
  TRL 1.16 (benchmark/trl116_rloo.py) and TRL 0.21 (benchmark/trl_rloo.py), alternating. Seconds and CUDA peak per
  phase, decoding GB/s against the copy, each phase's FLOP/s against the matmul; the bf16 sampling copy's
  mismatch/* metrics in its run.
- `plan_memory_k{2,4}`: plan_memory.py's prediction for the same flags against each phase's measured CUDA peak.
- `vllm_colocate`, `vllm_colocate_sleep`, `vllm_colocate_trl116`: rloo_multinode.py with a colocated vLLM engine,
  without and with sleep mode, and TRL 1.16 with its colocated engine (`use_vllm=True, vllm_mode="colocate"`): seconds
  per phase and the weight sync's seconds, which colocated is an in-process `load_weights`, no NCCL (a Llama of the
  pythia-1b shape: TRL 1.16 colocated on GPT-NeoX fails). `vllm_engine_nccl`: rloo_multinode.py with its engine on a
  second GPU, the weights broadcast over NCCL: the weight sync over NCCL, measured only where there are 2 GPUs (a
  trainer and an engine cannot share one in an NCCL communicator). Only where vLLM is importable (TRL 1.16's: vLLM
  0.22 to 0.31, the releases it supports); else each of these steps records one line saying why not.
- `learning`: the synthetic task (benchmark/synthetic_task.py) trained on the GPU, its reward-model score from the
  first 3 updates to the last 3 (make demo's check).
- `table`: the markdown rows of benchmark/README.md's GPU section, printed and written to `<results_dir>/table.md`.

`--dry_run` runs every step at tiny shapes on whatever device there is (CPU in make test: tests/test_gpu_suite.py),
so that the suite cannot rot between GPUs: steps that need CUDA or vLLM record why they measured nothing.
"""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmark import accounting, demo, generation_modes, throughput  # noqa: E402

VARIANTS = {  # throughput step: (trainer, rloo.py's own flags), in the order they alternate
    "rloo": ("rloo.py", []),
    "trl116": ("trl116", []),
    "rloo_bf16_generation": ("rloo.py", ["--bf16_generation"]),
    "trl021": ("trl", []),
    "rloo_compile_generation": ("rloo.py", ["--compile_generation"]),
}
TRL_VERSION = "0.21.0"


@dataclass
class Args:
    results_dir: str = "runs/gpu_suite"
    """where each step's JSON, the runs and the final table.md go (a step whose JSON is there is skipped)"""
    dry_run: bool = False
    """tiny shapes on any device (CPU included): checks that every step starts, writes its results and resumes"""
    shape: str = "pythia-1b"
    """the Pythia shape of the throughput and plan_memory steps (benchmark/throughput.py's list)"""
    rloo_ks: tuple[int, ...] = (2, 4)
    """completions per prompt: one set of throughput runs each"""
    updates: int = 4
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


def run_config(args: Args, k: int) -> throughput.RunConfig:
    """The throughput steps' configuration: the pythia-1b shape at TL;DR lengths, 64 completions per update, bf16
    autocast over fp32 master weights; on-policy (1 epoch, 1 minibatch). Dry run: pythia-14m, 32 + 8 tokens."""
    runs = Path(args.results_dir) / "runs"
    if args.dry_run:
        return throughput.RunConfig(
            shapes=("pythia-14m",), updates=2, warmup_updates=1, lengths="tldr", prompt_length=32, response_length=8,
            mean_response_length=None, per_device_train_batch_size=4, gradient_accumulation_steps=1,
            num_mini_batches=1, num_ppo_epochs=1, local_rollout_forward_batch_size=4, bf16=True,
            cache_dir=str(runs.parent / "cache"), runs_dir=str(runs))
    return throughput.RunConfig(
        shapes=(args.shape,), updates=args.updates, warmup_updates=1, lengths="tldr", prompt_length=512,
        response_length=53, mean_response_length=34.0, per_device_train_batch_size=16, gradient_accumulation_steps=4,
        num_mini_batches=1, num_ppo_epochs=1, local_rollout_forward_batch_size=16, bf16=True,
        cache_dir=".cache/throughput", runs_dir=str(runs))


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


# ---------------------------------------------------------------- steps: each returns what its JSON records


def limits(args: Args, _) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = {"matmul_size": 256, "copy_bytes": 2**24, "repeats": 2} if args.dry_run else {}
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else throughput.cpu_model()
    return {"status": "measured", "device": name,
            "bf16": accounting.measure_peaks(device, torch.bfloat16, **sizes),
            "fp32": accounting.measure_peaks(device, torch.float32, **sizes)}


def throughput_step(k: int, variant: str) -> Callable:
    def step(args: Args, results: Path) -> dict:
        trainer, own = VARIANTS[variant]
        config = run_config(args, k)
        shape = config.shapes[0]
        if trainer == "trl":
            problem = trl_problem(args)
            if problem:
                return {"status": f"skipped: {problem}"}
            site = ["env", f"PYTHONPATH={REPO_ROOT / args.trl_site}"] if args.trl_site else []
            command = site + [str(REPO_ROOT / args.trl_python), "benchmark/trl_rloo.py"]
        elif trainer == "trl116":
            command, problem = throughput.trl116_command(args.trl116_site)
            if problem:
                return {"status": f"skipped: {problem}"}
        else:
            command = [sys.executable, "rloo.py"]
        batch = config.per_device_train_batch_size * config.gradient_accumulation_steps * config.num_mini_batches
        assets = throughput.ensure_shape_assets(shape, (REPO_ROOT / config.cache_dir).resolve(),
                                                batch // k * config.updates, config)
        run_dir = throughput.fresh_run_dir(REPO_ROOT / config.runs_dir / f"throughput_k{k}_{variant}")
        full = command + throughput.trainer_flags(config, k, assets, run_dir) + own
        seconds, rss = throughput.run_trainer(full, run_dir.parent / f"{run_dir.name}.log", "gpu_suite")
        run = throughput.summarize_run(run_dir / "metrics.jsonl", config, rss)
        peaks = json.loads((results / "limits.json").read_text())["bf16" if config.bf16 else "fp32"]
        run.update(accounting.achieved(run, accounting.block_parameters(throughput.pythia_config(shape)), peaks))
        rows = read_rows(run_dir / "metrics.jsonl", config.warmup_updates)
        mismatch = {key: statistics.mean(row[key] for row in rows if key in row)
                    for key in sorted({key for row in rows for key in row if key.startswith("mismatch/")})}
        return {"status": "measured", "command": full, "wall_seconds": seconds, "shape": shape, "k": k,
                "trainer": trainer, "result": run, "mismatch": mismatch}
    return step


def plan_memory_step(k: int) -> Callable:
    def step(args: Args, results: Path) -> dict:
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
        run = measured["result"]
        phases = {phase: {"predicted_gib": predicted["training" if phase == "training" else "rollout"],
                          "measured_gib": run.get(f"{phase}_peak_gib")} for phase in throughput.PHASES}
        return {"status": "measured" if torch.cuda.is_available() else "predicted only: no CUDA peaks on this device",
                "gpu_gib": gpu_gib, "groups_gib": groups, "phases": phases}
    return step


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


def vllm_step(name: str) -> Callable:
    """rloo_multinode.py with a colocated vLLM engine (without and with sleep mode), TRL 1.16 with its colocated
    engine, and rloo_multinode.py with an engine in a process of its own on a second GPU, its weights sent over NCCL:
    one GPU has no NCCL weight sync to measure, as a trainer and an engine cannot share a GPU in one communicator."""
    def step(args: Args, results: Path) -> dict:
        if importlib.util.find_spec("vllm") is None:
            return {"status": "skipped: vLLM not importable"}
        if name == "vllm_colocate_sleep" and not torch.cuda.is_available():
            return {"status": "skipped: sleep mode needs CUDA"}
        if name == "vllm_engine_nccl" and torch.cuda.device_count() < 2:
            return {"status": f"skipped: a weight sync over NCCL needs 2 GPUs (the trainer's, the engine's); "
                              f"this machine has {torch.cuda.device_count()}: the colocated rows' sync is in-process"}
        if name == "vllm_colocate_trl116":
            trl116, problem = throughput.trl116_command(args.trl116_site)
            if problem:
                return {"status": f"skipped: {problem}"}
            low, high = (Version(v) for v in TRL116_VLLM)
            if not low <= Version(Version(vllm_version()).base_version) <= high:
                return {"status": f"skipped: TRL 1.16 supports vLLM {TRL116_VLLM[0]} to {TRL116_VLLM[1]}; this "
                                  f"machine has vLLM {vllm_version()}"}
        config = run_config(args, 2)
        hidden, layers, heads = throughput.PYTHIA_SHAPES[config.shapes[0]]
        shared = {f: getattr(config, f) for f in throughput.RunConfig.__dataclass_fields__}
        modes = generation_modes.Args(**{
            **shared, "rloo_k": 2, "hidden_size": hidden, "layers": layers, "heads": heads,
            "vllm_enable_sleep_mode": name == "vllm_colocate_sleep", "gpu_memory_utilization": 0.3,
            "mean_response_length": config.mean_response_length or float(config.response_length),
            "cache_dir": str(Path(config.cache_dir).parent / "generation_modes")})  # a Llama: vLLM colocates it
        batch = modes.per_device_train_batch_size * modes.gradient_accumulation_steps * modes.num_mini_batches
        assets = generation_modes.ensure_assets(modes, batch // 2 * modes.updates)
        run_dir = throughput.fresh_run_dir(REPO_ROOT / config.runs_dir / name)
        if name == "vllm_colocate_trl116":
            command = trl116 + ["--use_vllm"]
        elif name == "vllm_engine_nccl":  # the trainer on GPU 0, the engine rank 0 starts on GPU 1
            command = [sys.executable, "rloo_multinode.py", "--num_engines", "1", "--engine_devices", "1",
                       "--vllm_gpu_memory_utilization", "0.5"]
        else:
            command = generation_modes.mode_command("colocate", modes)
        full = command + throughput.trainer_flags(modes, 2, assets, run_dir)
        seconds, rss = throughput.run_trainer(full, run_dir.parent / f"{run_dir.name}.log", "gpu_suite")
        run = throughput.summarize_run(run_dir / "metrics.jsonl", modes, rss)
        rows = read_rows(run_dir / "metrics.jsonl", modes.warmup_updates)
        run["weight_sync_s"] = statistics.mean(row.get("time/weight_sync", 0.0) for row in rows)
        return {"status": "measured", "command": full, "wall_seconds": seconds, "weight_sync": VLLM_STEPS[name],
                "result": run}
    return step


def learning(args: Args, results: Path) -> dict:
    cache = Path(args.results_dir) / "cache" / "synthetic_task" if args.dry_run else REPO_ROOT / ".cache/rloo_demo"
    if args.dry_run:  # a weaker task built in seconds: the dry run checks the step, not the learning
        from benchmark.synthetic_task import asset_paths, build_assets

        paths = asset_paths(cache)
        if not paths["done"].exists():
            build_assets(paths, policy_steps=2, reward_steps=2)
    assets = demo.ensure_assets(cache)
    output_dir = Path(args.results_dir).resolve() / "runs" / "learning"
    episodes = 128 if args.dry_run else args.learning_episodes
    command = demo.rloo_command(demo.Args(output_dir=str(output_dir), total_episodes=episodes), assets) + (
        ["--bf16"] if torch.cuda.is_available() else [])
    if args.dry_run:
        command += ["--num_sample_generations", "0"]
    log = output_dir.parent / "learning.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    seconds, _ = throughput.run_trainer(command, log, "gpu_suite")
    scores = [row["objective/scores"] for row in read_rows(output_dir / "metrics.jsonl", 0)]
    first, last = statistics.mean(scores[:3]), statistics.mean(scores[-3:])
    return {"status": "measured", "command": command, "wall_seconds": seconds, "updates": len(scores),
            "score_first_3": first, "score_last_3": last, "learns": last - first >= demo.MIN_RISE}


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table(args: Args, results: Path) -> dict:
    """benchmark/README.md's GPU rows from the steps' JSON files."""
    order = list(steps(args))  # the suite's order (throughput's alternation); files of other steps after them
    read = {path.stem: json.loads(path.read_text()) for path in sorted(
        results.glob("*.json"), key=lambda path: (order.index(path.stem) if path.stem in order else len(order),
                                                  path.stem))}
    device = read.get("limits", {}).get("device", "?")
    lines = [f"Device: {device}. " + (
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
    print(text)
    (results / "table.md").write_text(text)
    return {"status": "written", "markdown": text}


def steps(args: Args) -> dict[str, Callable]:
    """The suite in order: name -> step(args, results_dir) -> what its JSON records."""
    out = {"limits": limits}
    for k in args.rloo_ks:
        out.update({f"throughput_k{k}_{variant}": throughput_step(k, variant) for variant in VARIANTS})
    out.update({f"plan_memory_k{k}": plan_memory_step(k) for k in args.rloo_ks})
    out.update({name: vllm_step(name) for name in VLLM_STEPS})
    out["learning"] = learning
    return out


def main(args: Args) -> None:
    if args.shape not in throughput.PYTHIA_SHAPES:
        sys.exit(f"gpu_suite: unknown shape {args.shape}; choose from {list(throughput.PYTHIA_SHAPES)}")
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("gpu_suite: no CUDA device; --dry_run runs the suite at tiny shapes on this machine")
    results = (REPO_ROOT / args.results_dir).resolve()
    results.mkdir(parents=True, exist_ok=True)
    args = replace(args, results_dir=str(results))
    failed = []
    for name, step in steps(args).items():
        path = results / f"{name}.json"
        if path.exists():
            print(f"== {name}: done earlier ({path.name}), skipped", flush=True)
            continue
        print(f"== {name}", flush=True)
        start = time.time()
        try:
            record = {"step": name, **step(args, results), "seconds": time.time() - start}
        except (Exception, SystemExit) as e:  # the other steps still run (GPU time is short); this one runs again
            # at the next start, as nothing is written for it
            failed.append(name)
            print(f"== {name}: FAILED, nothing written, it runs again next time: "
                  f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]}", flush=True)
            continue
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"== {name}: {record['status']} ({record['seconds']:.0f} s)", flush=True)
    table(args, results)  # always from whatever the steps have written
    print(f"results: {results}")
    if failed:
        sys.exit(f"gpu_suite: {len(failed)} step(s) failed: {', '.join(failed)} (their output above; run again to "
                 "retry them, the others are skipped)")


if __name__ == "__main__":
    import plumbing

    plumbing.run_tool("gpu_suite.py", Args, main)
