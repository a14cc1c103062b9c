"""Expected per-GPU memory of an rloo.py run, and which options make it fit. Nothing is loaded but the configs.

    python plan_memory.py --model_name_or_path EleutherAI/pythia-6.9b-deduped --reward_model_path ... \\
        --per_device_train_batch_size 8 --local_rollout_forward_batch_size 16 --bf16 --world_size 8 --gpu_gib 80

It takes rloo.py's flags (paste your command) plus the world size and the GPU's memory. The arithmetic:

- Resident: the policy's fp32 weights, gradients and AdamW m and v (16 bytes per parameter, divided by the world
  size with --fsdp), DDP's gradient buckets (4 more bytes, with DDP over more than one rank), the frozen reference
  and reward models (2 bytes per parameter with --bf16, else 4), and with --bf16_generation the bf16 copy that
  samples (2 bytes per parameter).
- Rollout, on top: the KV cache of a chunk (local_rollout_forward_batch_size x (prompt + response) tokens x
  layers x 2 x hidden), the gathered policy with --fsdp, autocast's bf16 weight copies with --bf16, and the
  log-prob pass's buffers over the vocabulary.
- Training, on top: a micro-batch's activations, (10 x hidden + 2 x intermediate) values per token per layer
  (layer inputs only, plus one recomputed layer, with --gradient_checkpointing), 3.2 fp32 buffers of
  micro-batch x response x vocabulary for the logits and the selective log-softmax, and bf16 weight copies. With
  shared prompts (--share_prompt, when a micro-batch holds whole prompt groups) a micro-batch is
  micro / k rows of prompt + k x response tokens; else micro rows of prompt + response.
- --use_peft (LoRA): the base's fp32 weights stay, but gradients, AdamW state and DDP's buckets are those of the
  adapters (and --lora_modules_to_save) only, counted on the model with peft's adapters added; there is no
  reference (the base with the adapters off is the reference). Activations are taken as full fine-tuning's. With
  --fsdp the base is sharded as the weights of full fine-tuning are, and so is AdamW's state; the adapters'
  gradients are held whole (summed over an optimizer step's micro-batches, reduce-scattered at its last).
- --offload (with --fsdp): the policy's weights, gradients and AdamW state and the frozen models stay in CPU
  memory; the rollout counts the reference and reward models visiting the GPU together (an upper bound: the
  reward model comes after the reference has left).
- Prompts are taken at max_prompt_length. CUDA's own context, cuBLAS workspaces and NCCL buffers (~1-2 GiB)
  and allocator fragmentation are not in the sum.

The activation constants were measured on GPT-NeoX (Pythia) blocks in fp32 with PyTorch's tracker. The test
(tests/test_plan_memory.py) checks the weights, gradients and optimizer state exactly and the activations
within the tolerance docs/speed-and-memory.md states, on tiny models.
"""

import itertools
import math
from dataclasses import dataclass, replace

import plumbing  # first, before torch loads: OMP_WAIT_POLICY, and Ctrl-C while importing (plumbing/startup.py)
import torch

import rloo

GIB = 2**30
LOGIT_BUFFERS = 3.2  # fp32 (N, Tr, V) buffers alive at the training peak: logits, softmax, backward
BF16_ACTIVATION_FACTOR = 0.6  # bytes of activations under bf16 autocast / fp32 (measured: 0.59)


@dataclass
class PlanArgs(rloo.Args):
    world_size: int = 8
    """GPUs the run uses (torchrun's WORLD_SIZE)"""
    gpu_gib: float = 80.0
    """memory of one GPU, GiB"""
    entropy_in_loss: bool = False
    """a loss that uses the policy's entropy (an entropy bonus, README "Changing the algorithm"): its gradient keeps
    one more (N, Tr, V) fp32 buffer in the log-probs' backward pass"""


def validate_plan_args(args: PlanArgs) -> None:
    """rloo.py's checks, and the machine's numbers: a verdict on 0 GPUs or nan GiB would mean nothing."""
    if args.load_in_4bit:
        raise plumbing.ConfigError("--load_in_4bit: the planner counts the base's weights in fp32 (4 bytes each), not "
                                   "in 4 bits (about 0.5): plan without the flag for an upper bound")
    plumbing.validate_args(args, launching=False)  # a plan for a torchrun launch (--fsdp) is made without one
    for name, value, allowed, requirement in [
        ("world_size", args.world_size, args.world_size >= 1, "at least 1 (the number of GPUs)"),
        ("gpu_gib", args.gpu_gib, math.isfinite(args.gpu_gib) and args.gpu_gib > 0, "a finite number of GiB > 0"),
    ]:
        if not allowed:
            raise plumbing.ConfigError(f"{name} = {value!r} must be {requirement}")


@dataclass(frozen=True)
class Shape:
    """What the arithmetic needs of a model."""

    parameters: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    trainable: int | None = None  # with --use_peft, the adapters' (and --lora_modules_to_save's); None: all


def model_shape(path: str, sequence_classifier: bool, trust_remote_code: bool,
                lora: rloo.Args | None = None, fsdp: bool = False) -> Shape:
    """The model's parameter count (built on the meta device: no memory, no weights; with `lora`, the Args of a
    --use_peft run, its adapters added as rloo.py adds them) and dimensions; with `fsdp`, refused as --fsdp
    refuses a model without transformer blocks to shard."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = plumbing.load_pretrained(AutoConfig.from_pretrained, path, "config", trust_remote_code=trust_remote_code)
    if sequence_classifier:
        config.num_labels = 1
    auto = AutoModelForSequenceClassification if sequence_classifier else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
        if lora is not None:
            plumbing.add_adapters(model, lora, None)  # and its refusals (no module to adapt), as rloo.py's
        if fsdp:
            plumbing.transformer_blocks(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if lora is not None else None
    return Shape(parameters, text.hidden_size,
                 getattr(text, "intermediate_size", 4 * text.hidden_size), text.num_hidden_layers, text.vocab_size,
                 trainable)


def activation_bytes(tokens: float, shape: Shape, checkpointing: bool, bf16: bool) -> float:
    """Saved activations of `tokens` tokens through every layer (or, with checkpointing, the layer inputs and one
    recomputed layer)."""
    per_layer = tokens * (10 * shape.hidden + 2 * shape.intermediate) * 4  # fp32 values saved for backward
    if checkpointing:
        total = shape.layers * tokens * shape.hidden * 4 + per_layer
    else:
        total = shape.layers * per_layer
    return total * (BF16_ACTIVATION_FACTOR if bf16 else 1.0)


def plan(args: PlanArgs, policy: Shape, reward: Shape | None) -> dict[str, dict[str, float]]:
    """Bytes per GPU by component, in three groups: resident, rollout (on top), training (on top)."""
    shards = args.world_size if args.fsdp else 1
    frozen = 2 if args.bf16 else 4
    p = policy.parameters
    trained = p if policy.trainable is None else policy.trainable
    with_reference = args.kl_coef != 0 and not args.use_peft  # LoRA's reference is the base itself
    on_gpu = 0.0 if args.offload else 1.0  # --offload: these live in CPU memory
    frozen_bytes = (frozen * p if with_reference else 0.0) + (frozen * reward.parameters if reward else 0.0)
    resident = {
        "policy weights (fp32)": on_gpu * 4 * p / shards,
        "policy gradients (fp32)": on_gpu * 4 * trained / (1 if args.use_peft else shards),
        "AdamW m and v (fp32)": on_gpu * 8 * trained / shards,
        "DDP gradient buckets": 4 * trained if not args.fsdp and args.world_size > 1 else 0.0,
        "reference policy": on_gpu * frozen * p if with_reference else 0.0,
        "reward model": on_gpu * frozen * reward.parameters if reward is not None else 0.0,
        "bf16 sampling copy (--bf16_generation)": 2 * p if args.bf16_generation else 0.0,
    }
    tokens = args.max_prompt_length + args.response_length
    chunk = args.local_rollout_forward_batch_size or 1  # 0: chunks sized to the memory left, so at least one row
    block = frozen * p / policy.layers  # one transformer block in the compute dtype
    if args.fsdp:
        gathered = frozen * p if args.fsdp_generation == "unshard" else 2 * block
    else:
        gathered = 2 * p if args.bf16 else 0.0  # autocast's cached bf16 copies of the weights
    rollout = {
        "gathered / bf16 policy weights": gathered,
        "KV cache of a chunk": chunk * tokens * policy.layers * 2 * policy.hidden * frozen,
        "log-prob buffers of a chunk": 2 * chunk * args.response_length * policy.vocab * 4,
        "offloaded frozen models, visiting": frozen_bytes if args.offload else 0.0,
    }
    micro = args.per_device_train_batch_size
    # whole prompt groups: each prompt once per row (None, the default: on where the model can take it)
    shared = args.share_prompt is not False and micro % args.rloo_k == 0
    micro_tokens = micro * (args.max_prompt_length / args.rloo_k + args.response_length) if shared else micro * tokens
    training = {
        "gathered / bf16 policy weights": (2 * block + 2 * 4 * p / policy.layers) if args.fsdp
        else (2 * p if args.bf16 else 0.0),
        "activations of a micro-batch": activation_bytes(micro_tokens, policy, args.gradient_checkpointing,
                                                         args.bf16),
        "logits and log-softmax of a micro-batch": (LOGIT_BUFFERS + args.entropy_in_loss) * micro
        * args.response_length * policy.vocab * 4,
    }
    return {"resident": resident, "rollout": rollout, "training": training}


def peak_bytes(groups: dict[str, dict[str, float]]) -> float:
    return sum(groups["resident"].values()) + max(sum(groups["rollout"].values()), sum(groups["training"].values()))


def options_that_fit(args: PlanArgs, policy: Shape, reward: Shape | None) -> list[tuple[str, float]]:
    """Changes to the given flags (fewest first) whose plan fits the GPU; the global batch is kept by trading
    micro-batch size for gradient accumulation steps."""
    precision = [("", {})] + ([("--bf16", {"bf16": True})] if not args.bf16 else [])
    checkpointing = [("", {})] + ([("--gradient_checkpointing", {"gradient_checkpointing": True})]
                                  if not args.gradient_checkpointing else [])
    sharding = [("", {})]
    if args.world_size > 1 and not args.fsdp:
        sharding.append(("--fsdp", {"fsdp": True}))
    if args.world_size > 1 and args.fsdp_generation != "per_block":
        sharding.append(("--fsdp --fsdp_generation per_block", {"fsdp": True, "fsdp_generation": "per_block"}))
    if not args.offload:  # last resort, on any GPU count: slower, so listed after the others
        sharding += [("--fsdp --offload", {"fsdp": True, "offload": True}),
                     ("--fsdp --fsdp_generation per_block --offload",
                      {"fsdp": True, "fsdp_generation": "per_block", "offload": True})]
    candidates = []
    for choice in itertools.product(precision, checkpointing, sharding):
        changes = {k: v for _, change in choice for k, v in change.items()}
        for halvings in range(4):
            micro = args.per_device_train_batch_size >> halvings
            if micro < 1:
                break
            trial = replace(args, **changes, per_device_train_batch_size=micro,
                            local_rollout_forward_batch_size=max(1, args.local_rollout_forward_batch_size >> halvings))
            peak = peak_bytes(plan(trial, policy, reward))
            if peak <= args.gpu_gib * GIB:
                label = [name for name, _ in choice if name] + ([
                    f"--per_device_train_batch_size {micro} (x{2**halvings} the accumulation steps) "
                    f"--local_rollout_forward_batch_size {trial.local_rollout_forward_batch_size}"] if halvings else [])
                candidates.append((len(label), " ".join(label) or "as given", peak))
                break
    return [(label, peak) for _, label, peak in sorted(candidates, key=lambda c: (c[0], "--offload" in c[1], c[2]))]


def main(args: PlanArgs) -> None:
    validate_plan_args(args)
    rloo.compute_batch_sizes(args, args.world_size)
    policy_path = args.sft_model_path or args.model_name_or_path
    plumbing.check_model_configs(args, plumbing.load_config(policy_path, "policy", args.trust_remote_code,
                                                             args.model_revision), args.max_prompt_length)  # the
    # plan's prompts are --max_prompt_length tokens long: positions the models do not have are refused, no plan
    policy = model_shape(policy_path, False, args.trust_remote_code, args if args.use_peft else None, args.fsdp)
    reward = model_shape(args.reward_model_path, True, args.trust_remote_code) if args.reward_model_path else None
    groups = plan(args, policy, reward)
    lora = f" ({policy.trainable / 1e6:.3g}M in LoRA adapters)" if policy.trainable is not None else ""
    print(f"{policy_path}: {policy.parameters / 1e9:.3g}B parameters{lora}; {args.world_size} GPUs of "
          f"{args.gpu_gib:g} GiB; "
          f"{'FSDP' if args.fsdp else 'DDP'}{', bf16' if args.bf16 else ''}"
          f"{', gradient checkpointing' if args.gradient_checkpointing else ''}{', offload' if args.offload else ''}")
    for group, parts in groups.items():
        print(f"  {group} ({sum(parts.values()) / GIB:.1f} GiB{'' if group == 'resident' else ', on top'})")
        for name, value in parts.items():
            if value:
                print(f"    {name:<42} {value / GIB:8.2f} GiB")
    peak = peak_bytes(groups)
    verdict = "fits" if peak <= args.gpu_gib * GIB else "does NOT fit"
    print(f"  peak ~{peak / GIB:.1f} GiB per GPU: {verdict} in {args.gpu_gib:g} GiB "
          f"(plus ~1-2 GiB of CUDA context, workspaces and fragmentation)")
    if peak > args.gpu_gib * GIB:
        fitting = options_that_fit(args, policy, reward)
        print("  options that fit:" if fitting else "  no combination of --bf16, --gradient_checkpointing, --fsdp, "
              "--offload and smaller micro-batches fits: use more GPUs")
        for label, value in fitting[:6]:
            print(f"    {label}: ~{value / GIB:.1f} GiB")


if __name__ == "__main__":
    plumbing.run_script(main, plumbing.parse_args(PlanArgs, prog="plan_memory.py"), "plan_memory.py")
