"""How far each phase is from the machine's limit: achieved FLOP/s and bytes/s against two ceilings measured on the
machine itself (a large matrix product and a large memory copy), never a datasheet number. Shared by
benchmark/throughput.py (any machine) and benchmark/gpu_suite.py.

FLOPs are counted from the model's config: N = the parameters of the transformer blocks (the input embedding, a
lookup, and the LM head left out), T = the token positions a phase feeds through the model's forward passes
(`work/<phase>_tokens`, padding included). A forward pass costs 2 N T, training (forward and backward) 6 N T.
Attention's scores and the LM head are not counted, so the achieved FLOP/s are a lower bound of the arithmetic
done, and the same rule for both trainers. Decoding's bytes are `work/decode_bytes` (every weight and the whole
KV cache read at each step).
"""

import statistics
import time

import torch

FORWARD_PHASES = ("generation", "policy_forward", "reference_forward", "scoring", "training")


def block_parameters(config) -> int:
    """N: parameters of the transformer blocks of a causal LM built from `config` on the meta device (no memory),
    the input embedding and the LM head left out."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    left_out = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
                for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in left_out)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocation, kernel selection
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_peaks(device: torch.device, dtype: torch.dtype = torch.float32, matmul_size: int | None = None,
                  copy_bytes: int | None = None, repeats: int = 5) -> dict:
    """The machine's two ceilings: a (n, n) @ (n, n) product in `dtype` on random data (2 n^3 FLOPs) and a copy of
    `copy_bytes` bytes from one buffer to another (read plus write: 2 x copy_bytes), medians of `repeats` after a
    warm-up. Sizes default to ones that fill the device: n = 8192 and 2 GiB on CUDA, 2048 and 256 MiB on CPU."""
    cuda = device.type == "cuda"
    n = matmul_size or (8192 if cuda else 2048)
    nbytes = copy_bytes or (2**31 if cuda else 2**28)
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    matmul_s = _median_seconds(lambda: a @ b, device, repeats)
    del a, b
    source = torch.randn(nbytes // 4, device=device, generator=generator)
    target = torch.empty_like(source)
    copy_s = _median_seconds(lambda: target.copy_(source), device, repeats)
    del source, target
    return {"matmul_dtype": str(dtype).removeprefix("torch."), "matmul_size": n,
            "matmul_tflop_per_s": 2 * n**3 / matmul_s / 1e12, "copy_bytes": nbytes,
            "copy_gb_per_s": 2 * nbytes / copy_s / 1e9}


def phase_flops(phase: str, tokens: float, parameters: int) -> float:
    """FLOPs of a phase that fed `tokens` positions through a model of `parameters` block parameters: 2 N T
    forward, 6 N T for training (its forward and backward)."""
    return (6 if phase == "training" else 2) * parameters * tokens


def achieved(run: dict, parameters: int, peaks: dict) -> dict:
    """A run's per-phase achieved rates from its averages (`<phase>_s`, `<phase>_tokens`, `generation_gb_per_s`):
    `<phase>_tflop_per_s` and its share of the measured matmul rate, decoding's GB/s share of the measured copy."""
    out = {}
    for phase in FORWARD_PHASES:
        seconds, tokens = run.get(f"{phase}_s", 0.0), run.get(f"{phase}_tokens", 0.0)
        if seconds > 0 and tokens > 0:
            rate = phase_flops(phase, tokens, parameters) / seconds / 1e12
            out[f"{phase}_tflop_per_s"] = rate
            out[f"{phase}_of_matmul"] = rate / peaks["matmul_tflop_per_s"]
    if run.get("generation_gb_per_s"):
        out["decoding_of_copy"] = run["generation_gb_per_s"] / peaks["copy_gb_per_s"]
    return out


def limits_table(rows: dict[str, dict], peaks: dict) -> str:
    """Markdown: for each labelled run's `achieved` rates, each phase's TFLOP/s (its % of the matmul) and decoding's
    GB/s (its % of the copy)."""
    head = (f"| run | decoding GB/s (% of copy {peaks['copy_gb_per_s']:.1f}) | "
            + " | ".join(f"{phase} TFLOP/s" for phase in FORWARD_PHASES)
            + f" |\n|---|---|{'---|' * len(FORWARD_PHASES)}\n")
    lines = []
    for label, rates in rows.items():
        decoding = (f"{rates['generation_gb_per_s']:.1f} ({100 * rates['decoding_of_copy']:.0f}%)"
                    if "decoding_of_copy" in rates else "-")
        cells = [f"{rates[f'{p}_tflop_per_s']:.3g} ({100 * rates[f'{p}_of_matmul']:.1f}%)"
                 if f"{p}_tflop_per_s" in rates else "-" for p in FORWARD_PHASES]
        lines.append(f"| {label} | {decoding} | " + " | ".join(cells) + " |")
    return (f"Against this machine's measured limits: a {peaks['matmul_dtype']} {peaks['matmul_size']}^3 matmul at "
            f"{peaks['matmul_tflop_per_s']:.3g} TFLOP/s, a {peaks['copy_bytes'] / 2**20:.0f} MiB copy at "
            f"{peaks['copy_gb_per_s']:.1f} GB/s (read + write). FLOPs: 2 N T forward, 6 N T training (N the blocks' "
            "parameters, T the phase's token positions).\n\n" + head + "\n".join(lines))
