#!/usr/bin/env bash
# GRPO with a KL loss (k3) against a reference model and a rule-based reward_func, 4 CPU ranks, every
# role colocated (the OpenRLHF docs' GRPO command, scaled down to the embedded tiny demo).
# Usage: bash launch/examples/grpo_tiny_cpu.sh OUT_DIR [extra train_ppo flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 4 -m rlhf.cli.train_ppo \
  "${cpu[@]}" \
  --pretrain "$tiny/policy" --remote_rm_url "$tiny/reward.py" \
  --prompt_data "$tiny/prompts.jsonl" --input_key input --label_key label \
  --colocate_all_models \
  --advantage_estimator group_norm --use_kl_loss --kl_estimator k3 --init_kl_coef 0.001 \
  --n_samples_per_prompt 8 --rollout_batch_size 16 --micro_rollout_batch_size 32 \
  --train_batch_size 64 --micro_train_batch_size 16 \
  --generate_max_len 8 --prompt_max_len 16 \
  --actor_learning_rate 3e-3 --lr_warmup_ratio 0.05 \
  --zero_stage 2 --num_episodes 8 --max_steps 200 --seed 1 \
  --save_path "$out" --use_tensorboard "$out/tensorboard" \
  "$@"
