#!/usr/bin/env bash
# PPO (GAE, critic, reward model, reference model, KL penalty) on the embedded tiny demo, 4 CPU ranks:
# actor + reference on ranks 0-1, critic + reward model on ranks 2-3 (the OpenRLHF docs' PPO command,
# scaled down). Usage: bash launch/examples/ppo_tiny_cpu.sh OUT_DIR [extra train_ppo flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 4 -m rlhf.cli.train_ppo \
  "${cpu[@]}" \
  --pretrain "$tiny/policy" \
  --reward_pretrain "$tiny/reward_model" \
  --actor_num_nodes 1 --actor_num_gpus_per_node 2 \
  --ref_num_nodes 1 --ref_num_gpus_per_node 2 \
  --critic_num_nodes 1 --critic_num_gpus_per_node 2 \
  --reward_num_nodes 1 --reward_num_gpus_per_node 2 \
  --colocate_actor_ref --colocate_critic_reward \
  --advantage_estimator gae --gamma 1.0 --lambd 0.95 \
  --init_kl_coef 0.001 --kl_estimator k1 \
  --prompt_data "$tiny/prompts.jsonl" --input_key input \
  --n_samples_per_prompt 1 --rollout_batch_size 64 --micro_rollout_batch_size 32 \
  --train_batch_size 32 --micro_train_batch_size 16 --max_epochs 1 \
  --generate_max_len 8 --prompt_max_len 16 \
  --actor_learning_rate 2e-3 --critic_learning_rate 5e-3 --lr_warmup_ratio 0.05 \
  --value_clip 0.2 --eps_clip 0.2 --normalize_reward \
  --zero_stage 2 --num_episodes 20 --max_steps 50 --seed 1 \
  --save_path "$out" --use_tensorboard "$out/tensorboard" \
  "$@"
