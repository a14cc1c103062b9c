"""What rloo_multinode.py's weight sync and engines cost, computed from the Pythia configs (no GPU, no weights):
bytes broadcast per sync, its time over common links, and an engine GPU's room for KV cache; with LoRA (--use_peft),
what a sync after the first sends merged (the adapted modules and their siblings, --lora_sync merged) against the
adapters alone (--lora_sync adapters), computed for the Pythia shapes and measured on a tiny model with an hf engine
on this machine (rloo_multinode.py's own sync: the engine a process of its own, gloo between them).

    python benchmark/sync_cost.py            # docs/scaling-out.md's tables (--output benchmark/results/sync_cost.md)

Times assume a large-message NCCL broadcast reaches `EFFICIENCY` of the link's nominal one-way bandwidth; the sender's
link is the bottleneck (a pipelined broadcast to many receivers costs about what one receiver costs). Change the
constants to your hardware.
"""

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import plumbing  # noqa: E402  (before torch loads: OpenMP's idle threads sleep, plumbing/startup.py)
import torch  # noqa: E402
from benchmark.throughput import PYTHIA_SHAPES, pythia_config  # noqa: E402

WRITER = "benchmark/sync_cost.py"  # the mark of its output: a path that exists is replaced only if it has it

LINKS = {  # nominal one-way GB/s between trainer rank 0 and an engine, and bytes per parameter sent over it
    "NVLink 4 (H100 SXM)": (450.0, 2),  # vLLM engines, --bf16: weights travel in bf16
    "NVLink 3 (A100 SXM)": (300.0, 2),
    "InfiniBand NDR 400 Gb/s": (50.0, 2),
    "InfiniBand HDR 200 Gb/s": (25.0, 2),
    "Ethernet 25 Gb/s, hf engines (fp32)": (3.125, 4),  # hf engines keep fp32 weights
}
EFFICIENCY = 0.8


@dataclass
class Args:
    shapes: tuple[str, ...] = ("pythia-1b", "pythia-2.8b", "pythia-6.9b")
    """Pythia shapes, from benchmark/throughput.py's list"""
    sequence_tokens: int = 565
    """prompt + response tokens of one sequence (TL;DR: 512 + 53)"""
    engine_gpu_gib: float = 80.0
    """memory of one engine GPU"""
    gpu_memory_utilization: float = 0.9
    """vLLM's share of it (--vllm_gpu_memory_utilization)"""
    lora_ranks: tuple[int, ...] = (16, 64)
    """LoRA ranks of the computed LoRA rows"""
    lora_targets: tuple[str, ...] = ("peft's default", "all-linear")
    """the modules adapted in the LoRA rows: peft's default for GPT-NeoX (query_key_value), or a --lora_target_modules
    value"""
    measured_shape: Optional[str] = "pythia-14m"
    """the shape whose LoRA syncs are measured here, with an hf engine (a process of its own); None: none"""
    syncs: int = 9
    """syncs measured per case (their median and the fastest are shown), after the first, which sends every weight"""
    output: str = "runs/bench/sync_cost.md"
    """the Markdown tables are written here too (runs/ is not tracked; the committed file is
    benchmark/results/sync_cost.md)"""


def parameter_count(shape: str) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(pythia_config(shape))
    return sum(p.numel() for p in model.parameters())  # tied weights once, as the sync sends them


def lora_config_of(target: str, rank: int):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=None if target == "peft's default"
                      else target)


def lora_sent(shape: str, target: str, rank: int) -> tuple[int, int]:
    """(parameters a merged sync after the first sends, adapter parameters) of a Pythia shape with LoRA adapters of
    `rank` on `target`: rloo_multinode.py's own choice of weights (adapted_weights), on a model built without memory."""
    import rloo_multinode as mn
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(pythia_config(shape))
        model.add_adapter(lora_config_of(target, rank))
    weights = mn.engine_weights(model)
    merged = sum(weights[name].shape.numel() for name in mn.adapted_weights(model, list(weights)))
    return merged, sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_tables(args: Args) -> str:
    links = list(LINKS)[:4]  # vLLM engines: the merged weights travel in bf16, the adapters' files in fp32
    rows = ["| shape | LoRA rank | adapted | sync | parameters | bytes | " + " | ".join(links) + " |",
            "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in links) + " |"]
    for shape in args.shapes:
        for target in args.lora_targets:
            for rank in args.lora_ranks:
                merged, adapters = lora_sent(shape, target, rank)
                for sync, params, nbytes in (("merged (bf16)", merged, 2 * merged),
                                             ("adapters (fp32 files)", adapters, 4 * adapters)):
                    times = [nbytes / (LINKS[link][0] * 1e9 * EFFICIENCY) for link in links]
                    rows.append(f"| {shape} | {rank} | {target} | {sync} | {params / 1e6:.1f} M | {size(nbytes)} | "
                                + " | ".join(duration(t) for t in times) + " |")
    return "\n".join(rows)


def measured_lora_syncs(args: Args) -> str:
    """Bytes and seconds of a LoRA sync after the first, merged and adapters-only, measured with rloo_multinode.py's
    own sync to an hf engine it starts (gloo over loopback, fp32 on the wire; the seconds a run logs as
    time/engine_wait + time/weight_sync), the median and the fastest of --syncs syncs (on a shared machine the
    fastest is the cost, the median its neighbours' too); and the size of the adapter's files, which vLLM engines get
    instead."""
    import rloo_multinode as mn
    from transformers import AutoModelForCausalLM

    rows = ["| adapted | LoRA rank | sync | parameters | bytes | ms per sync, median | fastest | vLLM adapter files |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as folder:
        policy_path = Path(folder) / "policy"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(pythia_config(args.measured_shape)).save_pretrained(policy_path)
        for target in args.lora_targets:
            for rank in args.lora_ranks:
                for lora_sync in ("merged", "adapters"):
                    run = mn.Args(model_name_or_path=str(policy_path), engine="hf", output_dir=f"{folder}/out",
                                  engine_port=mn.free_engine_port(), use_peft=True, lora_r=rank, lora_alpha=2 * rank,
                                  lora_dropout=0.0, lora_sync=lora_sync,
                                  lora_target_modules=None if target == "peft's default" else (target,))
                    policy = plumbing.load_causal_lm(str(policy_path), torch.float32, False)
                    plumbing.add_adapters(policy, run, None)
                    dist_info = plumbing.Dist(0, 0, 1, torch.device("cpu"))
                    secret = "sync-cost-" + "0" * 32
                    store = mn.control_store(run, dist_info, torch.device("cpu"), mn.secret_key(secret))
                    engines = mn.ServedEngines(run, dist_info, store, mn.launch_engines(run, dist_info, store, secret))
                    rollouts = mn.EngineRollouts(policy, run, None, 0, torch.Generator(), dist_info, engines)
                    try:
                        seconds = []
                        for version in range(1, args.syncs + 1):
                            with torch.no_grad():
                                for p in policy.parameters():
                                    if p.requires_grad:
                                        p.add_(0.01)
                            start = time.perf_counter()
                            rollouts.policy_updated(version, policy)  # the run's time/engine_wait + time/weight_sync
                            seconds.append(time.perf_counter() - start)
                        files = sum(len(data) for data in mn.adapter_files(policy).values())
                        later = rollouts.synced.later.info
                    finally:
                        rollouts.close()
                    params = sum(torch.Size(shape).numel() for shape in later["shapes"])
                    rows.append(f"| {target} | {rank} | {lora_sync} | {params / 1e6:.2f} M | {size(4 * params)} | "
                                f"{statistics.median(seconds) * 1e3:.0f} | {min(seconds) * 1e3:.0f} | {size(files)} |")
    return "\n".join(rows)


def size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else \
        f"{nbytes / 1e3:.0f} kB"


def duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.0f} ms" if seconds < 1 else \
        f"{seconds:.1f} s"


def kv_bytes_per_token(shape: str, dtype_bytes: int = 2) -> int:
    hidden, layers, _ = PYTHIA_SHAPES[shape]
    return 2 * layers * hidden * dtype_bytes  # a key and a value vector per layer


def tables(args: Args) -> str:
    links = list(LINKS)
    sync = ["| shape | parameters | bf16 bytes per sync | " + " | ".join(links) + " |",
            "| --- | --- | --- | " + " | ".join("---" for _ in links) + " |"]
    engine = ["| shape | bf16 weights | KV cache per token | per sequence | sequences in the KV cache of one engine GPU |",
              "| --- | --- | --- | --- | --- |"]
    for shape in args.shapes:
        params = parameter_count(shape)
        nbytes = 2 * params
        times = [params * LINKS[link][1] / (LINKS[link][0] * 1e9 * EFFICIENCY) for link in links]
        sync.append(f"| {shape} | {params / 1e9:.2f} B | {nbytes / 1e9:.1f} GB | "
                    + " | ".join(f"{t * 1e3:.0f} ms" if t < 1 else f"{t:.1f} s" for t in times) + " |")
        kv = kv_bytes_per_token(shape)
        room = args.engine_gpu_gib * 2**30 * args.gpu_memory_utilization - nbytes
        engine.append(f"| {shape} | {nbytes / 2**30:.1f} GiB | {kv / 2**10:.0f} KiB | "
                      f"{kv * args.sequence_tokens / 2**20:.0f} MiB | {int(room // (kv * args.sequence_tokens))} |")
    text = (f"Weight sync, computed: bytes per sync / (link bandwidth x {EFFICIENCY})\n\n" + "\n".join(sync)
            + f"\n\nEngine memory, computed for {args.sequence_tokens}-token sequences on a {args.engine_gpu_gib:.0f} GiB "
            f"GPU at {args.gpu_memory_utilization} utilization (activations and CUDA graphs not counted)\n\n"
            + "\n".join(engine) + "\n")
    text += ("\nLoRA (--use_peft), a sync after the first (which sends every weight, as above), computed: merged, the "
             "adapted modules and their siblings in bf16; adapters, the adapter's files (fp32), which vLLM then loads "
             f"from disk (not counted); time = bytes / (link bandwidth x {EFFICIENCY})\n\n" + lora_tables(args) + "\n")
    if args.measured_shape is not None:
        text += (f"\nLoRA syncs measured on this machine ({args.measured_shape} shape, an hf engine in a process of "
                 "its own, gloo over loopback, fp32 on the wire; the seconds a run logs as time/engine_wait + "
                 "time/weight_sync, the engine idle; the vLLM engines' adapter files, measured, go through the "
                 "control store, or a folder `vllm serve` reads)\n\n" + measured_lora_syncs(args) + "\n")
    return text


def main(args: Args) -> None:
    unknown = [s for s in (*args.shapes, args.measured_shape or "pythia-14m") if s not in PYTHIA_SHAPES]
    if unknown:
        raise plumbing.ConfigError(f"--shapes: unknown shape(s) {unknown}; choose from {list(PYTHIA_SHAPES)}")
    plumbing.check_outputs([("--output", Path(args.output))], [], WRITER)
    if min(args.sequence_tokens, args.engine_gpu_gib, args.gpu_memory_utilization) <= 0:
        raise plumbing.ConfigError("--sequence_tokens, --engine_gpu_gib and --gpu_memory_utilization must be > 0")
    text = tables(args)
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    plumbing.write_own(Path(args.output), plumbing.marked_text(text + "\n", WRITER))


if __name__ == "__main__":
    plumbing.run_tool("sync_cost.py", Args, main)
