#!/usr/bin/env bash
# TRL's published RLOO run on TL;DR: Pythia-1B SFT and reward models from "The N+ Implementation Details of
# RLHF with PPO", 8 GPUs. TRL's run reached a 51.2% win rate against the reference summaries (gpt-4o-mini
# judge, 1000 posts), from the SFT model's 33.0%.
#
# Batch: 16 per device x 16 accumulation steps x 2 minibatches = 512 completions per GPU (256 prompts x k=2),
# x 8 GPUs = 4096 completions per update; 1,000,000 episodes = 245 updates.
#
#   bash benchmark/tldr/rloo_tldr_1b.sh                             # from any directory
#   SEED=2 bash benchmark/tldr/rloo_tldr_1b.sh --num_evals 8         # extra arguments go to rloo.py
#
# Environment: SEED (1); K, the rloo_k (2: the prompts per update change, the completions do not);
# OUTPUT_DIR, relative to the repo root (models/rloo_tldr_1b_seed<SEED>, with _k<K> before _seed when K is
# set); NPROC, GPUs (8: fewer shrink the global batch, so raise --gradient_accumulation_steps to keep it);
# PYTHIA, the model size of the SFT and reward models (1b; the 2.8B and 6.9B scripts set it);
# TORCHRUN_ARGS, extra torchrun flags (rloo_tldr.sbatch passes its signal handling there); TRAINER, the
# script torchrun runs (rloo.py; rloo_multinode.py with its engine flags after the file name, as
# rloo_tldr_multinode.sbatch does). Checkpoints every 10 updates and --resume make the same command start the
# run and continue it after a preemption.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTPUT_DIR=${OUTPUT_DIR:-models/$(basename "$0" .sh)${K:+_k$K}_seed${SEED:-1}}
PYTHIA=${PYTHIA:-1b}
# TORCHRUN_ARGS is split into words on purpose
# shellcheck disable=SC2086
exec torchrun --nproc_per_node "${NPROC:-8}" ${TORCHRUN_ARGS:-} "${TRAINER:-rloo.py}" \
    --exp_name "rloo_tldr_${PYTHIA//./p}" \
    --seed "${SEED:-1}" \
    --output_dir "$OUTPUT_DIR" \
    --dataset_name trl-internal-testing/tldr-preference-sft-trl-style \
    --dataset_test_split validation \
    --model_name_or_path "EleutherAI/pythia-$PYTHIA-deduped" \
    --sft_model_path "cleanrl/EleutherAI_pythia-$PYTHIA-deduped__sft__tldr" \
    --reward_model_path "cleanrl/EleutherAI_pythia-$PYTHIA-deduped__reward__tldr" \
    --rloo_k "${K:-2}" \
    --kl_coef 0.03 \
    --missing_eos_penalty 1.0 \
    --stop_token eos \
    --response_length 53 \
    --temperature 0.7 \
    --learning_rate 3e-6 \
    --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 16 \
    --num_mini_batches 2 \
    --num_ppo_epochs 2 \
    --total_episodes 1000000 \
    --local_rollout_forward_batch_size 16 \
    --bf16 \
    --track \
    --save_steps 10 \
    --resume \
    "$@"
