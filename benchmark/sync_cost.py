"""What rloo_multinode.py's weight sync and engines cost, computed from the Pythia configs (no GPU, no weights):
bytes broadcast per sync, its time over common links, and an engine GPU's room for KV cache.

    python benchmark/sync_cost.py            # the table in the README's "Scaling out" section

Times assume a large-message NCCL broadcast reaches `EFFICIENCY` of the link's nominal one-way bandwidth; the sender's
link is the bottleneck (a pipelined broadcast to many receivers costs about what one receiver costs). Change the
constants to your hardware.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import plumbing  # noqa: E402
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
    output: str = "runs/bench/sync_cost.md"
    """the Markdown tables are written here too (runs/ is not tracked; the committed file is
    benchmark/results/sync_cost.md)"""


def parameter_count(shape: str) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(pythia_config(shape))
    return sum(p.numel() for p in model.parameters())  # tied weights once, as the sync sends them


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
    return (f"Weight sync, computed: bytes per sync / (link bandwidth x {EFFICIENCY})\n\n" + "\n".join(sync)
            + f"\n\nEngine memory, computed for {args.sequence_tokens}-token sequences on a {args.engine_gpu_gib:.0f} GiB "
            f"GPU at {args.gpu_memory_utilization} utilization (activations and CUDA graphs not counted)\n\n"
            + "\n".join(engine) + "\n")


def main(args: Args) -> None:
    unknown = [s for s in args.shapes if s not in PYTHIA_SHAPES]
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
