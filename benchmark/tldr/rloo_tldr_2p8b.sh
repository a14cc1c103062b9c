#!/usr/bin/env bash
# RLOO on TL;DR with Pythia-2.8B SFT and reward models ("The N+ Implementation Details of RLHF with PPO"),
# 8 GPUs, DDP. The hyperparameters are those of TRL's 1B run (rloo_tldr_1b.sh): TRL published no 2.8B RLOO
# run. Usage and environment (SEED, K, OUTPUT_DIR, NPROC, TORCHRUN_ARGS, extra arguments) as rloo_tldr_1b.sh,
# which it runs with PYTHIA=2.8b (the 2.8B models; rloo_tldr_6p9b.sh sets 6.9b) and the batch and memory
# settings below (the last copy of a flag wins).
#
# Batch: 8 per device x 32 accumulation steps x 2 minibatches = 512 completions per GPU (256 prompts x k=2),
# x 8 GPUs = 4096 completions per update, the 1B run's global batch; 1,000,000 episodes = 245 updates.
#
# Memory per GPU (GB = 1e9 bytes; an "80 GB" GPU holds 80 GiB = 85.9 GB). An estimate, not yet measured on GPUs:
#   policy fp32 weights + gradients + AdamW m and v: 2.8B x 16 bytes       44.8
#   DDP's gradient buckets (a second fp32 copy of the gradients)            11.2
#   bf16 reference policy and reward model: 2 x 2.8B x 2 bytes              11.2
#   resident                                                               ~67
#   + during forward/backward: autocast's bf16 copy of the policy weights 5.6, and activations of a micro-batch
#     of 8 with --gradient_checkpointing ~2.5 (layer inputs 32 x 8 x 565 tokens x 2560 in fp32 = 1.5, the
#     softmax of the 53 response positions only, 8 x 53 x 50k in fp32 = 0.09, one recomputed layer)  -> ~75
#   + during generation: that bf16 copy 5.6 and the KV cache of 16 completions 3.0            -> ~76
#   + during the optimizer step: nothing more (on CUDA rloo.py uses fused AdamW, which needs no temporaries)
# Without gradient checkpointing a completion of 565 tokens keeps roughly 1.5-3 GB of activations (all 32
# layers), 12-25 GB for the micro-batch of 8: it would not fit. If it runs out of memory anyway, pass
# --per_device_train_batch_size 4 --gradient_accumulation_steps 64 (same global batch).
set -euo pipefail
here=$(dirname "$0")
export OUTPUT_DIR=${OUTPUT_DIR:-models/$(basename "$0" .sh)${K:+_k$K}_seed${SEED:-1}}
PYTHIA=${PYTHIA:-2.8b} exec bash "$here/rloo_tldr_1b.sh" \
    --per_device_train_batch_size 8 \
    --gradient_accumulation_steps 32 \
    --gradient_checkpointing \
    "$@"
