#!/usr/bin/env bash
# The RLOO settings of "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
# Feedback in LLMs" (Ahmadian et al., 2024) on TRL's 1B TL;DR run: k=4 completions per prompt, KL coefficient
# 0.03, learning rate 1e-6 held constant. The paper trained Pythia-6.9B (RLOO k=4: 77.9% simulated GPT-4 win
# rate, k=2: 74.2%, PPO 67.6%) with a rollout batch of 512; this keeps the 1B models and everything else of
# rloo_tldr_1b.sh, which it runs with these flags added.
#
# Batch: 16 per device x 16 accumulation steps x 2 minibatches = 512 completions per GPU (128 prompts x k=4),
# x 8 GPUs = 4096 completions per update; 1,000,000 episodes = 245 updates.
#
# Environment and extra arguments as rloo_tldr_1b.sh; K defaults to 4 here, and OUTPUT_DIR to
# models/rloo_tldr_1b_k4_back_to_basics_seed<SEED> (with _k<K> before _seed when K is set).
set -euo pipefail
here=$(dirname "$0")
export OUTPUT_DIR=${OUTPUT_DIR:-models/$(basename "$0" .sh)${K:+_k$K}_seed${SEED:-1}}
export K=${K:-4}
exec bash "$here/rloo_tldr_1b.sh" \
    --exp_name rloo_tldr_1b_k4_back_to_basics \
    --kl_coef 0.03 \
    --learning_rate 1e-6 \
    --lr_scheduler_type constant \
    "$@"
