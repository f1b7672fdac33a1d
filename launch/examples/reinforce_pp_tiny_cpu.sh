#!/usr/bin/env bash
# REINFORCE++-baseline with a KL penalty in the reward, the tiny reward model, and disjoint ranks
# (actor+ref on 0-1, reward model on 2-3), 4 CPU ranks: the OpenRLHF docs' REINFORCE++ command scaled down.
# Usage: bash launch/examples/reinforce_pp_tiny_cpu.sh OUT_DIR [extra train_ppo flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 4 -m rlhf.cli.train_ppo \
  "${cpu[@]}" \
  --pretrain "$tiny/policy" --reward_pretrain "$tiny/reward_model" \
  --prompt_data "$tiny/prompts.jsonl" --input_key input \
  --actor_num_nodes 1 --actor_num_gpus_per_node 2 --ref_num_nodes 1 --ref_num_gpus_per_node 2 \
  --reward_num_nodes 1 --reward_num_gpus_per_node 2 --colocate_actor_ref \
  --advantage_estimator reinforce_baseline --init_kl_coef 0.001 --kl_estimator k2 \
  --n_samples_per_prompt 4 --rollout_batch_size 16 --micro_rollout_batch_size 32 \
  --train_batch_size 64 --micro_train_batch_size 16 \
  --generate_max_len 8 --prompt_max_len 16 \
  --actor_learning_rate 3e-3 --lr_warmup_ratio 0.05 \
  --zero_stage 2 --num_episodes 8 --max_steps 60 --seed 1 \
  --save_path "$out" --use_tensorboard "$out/tensorboard" \
  "$@"
