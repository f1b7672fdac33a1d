#!/usr/bin/env bash
# Multi-turn agent RL (--agent_func_path) on the embedded tiny demo, 2 CPU ranks: a digit-guessing game
# (rlhf/assets/tiny/guess_agent.py) whose wrong first guess gets a hint and a second try; GRPO, every role
# colocated. Usage: bash launch/examples/agent_tiny_cpu.sh OUT_DIR [extra train_ppo flags...]
# This small game learns bimodally within 320 steps: measured on 2 CPU cores, --seed 2 reaches a reward of 0.655 in
# the last fifth, --seed 1 and --seed 3 stay at 0.149 and 0.306 (README's examples table).
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_ppo \
  "${cpu[@]}" \
  --pretrain "$tiny/policy" --agent_func_path "$tiny/guess_agent.py" \
  --prompt_data "$tiny/guess_prompts.jsonl" --input_key input --label_key label \
  --agent_max_turns 2 --agent_turn_max_tokens 4 \
  --colocate_all_models \
  --advantage_estimator group_norm --use_kl_loss --kl_estimator k3 --init_kl_coef 0.001 \
  --n_samples_per_prompt 8 --rollout_batch_size 16 --micro_rollout_batch_size 32 \
  --train_batch_size 64 --micro_train_batch_size 16 \
  --generate_max_len 8 --prompt_max_len 8 \
  --actor_learning_rate 3e-3 --lr_warmup_ratio 0.05 \
  --zero_stage 2 --num_episodes 32 --max_steps 320 --seed 2 \
  --save_path "$out" --use_tensorboard "$out/tensorboard" \
  "$@"
