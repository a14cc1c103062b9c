#!/usr/bin/env bash
# RLOO on TL;DR with Pythia-6.9B SFT and reward models ("The N+ Implementation Details of RLHF with PPO"),
# 8 GPUs, the policy sharded with FSDP2 (--fsdp): DDP would keep 16 bytes per parameter, 110 GB, on every GPU.
# The hyperparameters are those of TRL's 1B run (rloo_tldr_1b.sh); "Back to Basics" trained its 6.9B RLOO with
# lr 1e-6 constant: add --learning_rate 1e-6 --lr_scheduler_type constant (and K=4 for its best run). Usage and
# environment (SEED, K, OUTPUT_DIR, NPROC, TORCHRUN_ARGS, extra arguments) as rloo_tldr_1b.sh. It runs
# rloo_tldr_2p8b.sh (its batch, gradient checkpointing) with PYTHIA=6.9b (the 6.9B models) and FSDP.
#
# Batch: 8 per device x 32 accumulation steps x 2 minibatches = 512 completions per GPU (256 prompts x k=2),
# x 8 GPUs = 4096 completions per update, the 1B run's global batch; 1,000,000 episodes = 245 updates.
#
# Memory per GPU (GB = 1e9 bytes; an "80 GB" GPU holds 85.9 GB). An estimate, not yet measured on GPUs:
#   policy fp32 weights + gradients + AdamW m and v, sharded 8 ways: 6.86B x 16 bytes / 8     13.7
#   bf16 reference policy and reward model, replicated: 2 x 6.86B x 2 bytes                   27.4
#   resident                                                                                 ~41
#   + during the rollout (--fsdp_generation unshard): the gathered bf16 policy 13.7 and the KV cache of 16
#     completions of 565 tokens (32 layers x 2 x 4096 x 2 bytes per token) 4.7                   -> ~60
#   + during forward/backward: two gathered bf16 blocks 0.9 and their fp32 gradients before the reduce-scatter
#     1.7, activations of a micro-batch of 8 with --gradient_checkpointing ~2.5 (layer inputs 32 x 8 x 565 x
#     4096 in bf16 = 1.2, one recomputed layer, the softmax of the 53 response positions 0.09)   -> ~46
# With --fsdp_generation per_block the rollout needs ~47 GB instead of ~60, and gathers each block at every
# decoding step (53 all-gathers of the whole policy per rollout chunk): use it only if unshard runs out of memory.
set -euo pipefail
here=$(dirname "$0")
export OUTPUT_DIR=${OUTPUT_DIR:-models/$(basename "$0" .sh)${K:+_k$K}_seed${SEED:-1}}
PYTHIA=6.9b exec bash "$here/rloo_tldr_2p8b.sh" --fsdp --fsdp_generation unshard "$@"
