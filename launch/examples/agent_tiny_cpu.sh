#!/usr/bin/env bash
# Multi-turn agent RL (--agent_func_path) on the embedded tiny demo, 2 CPU ranks: a digit game
# (rlhf/assets/tiny/guess_agent.py) whose wrong first answer gets a hint and a second try; GRPO, every role
# colocated. Half the prompts show the digit (the copy task's prompts.jsonl, `... copy D :`), half hide it
# (guess_prompts.jsonl): the first answer learns to copy, the second to use the hint (README's examples table).
# Usage: bash launch/examples/agent_tiny_cpu.sh OUT_DIR [extra train_ppo flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_ppo \
  "${cpu[@]}" \
  --pretrain "$tiny/policy" --agent_func_path "$tiny/guess_agent.py" \
  --prompt_data "$tiny/prompts.jsonl,$tiny/guess_prompts.jsonl" --prompt_data_probs 0.5,0.5 \
  --input_key input --label_key label \
  --agent_max_turns 2 --agent_turn_max_tokens 4 \
  --colocate_all_models \
  --advantage_estimator group_norm --use_kl_loss --kl_estimator k3 --init_kl_coef 0.001 \
  --n_samples_per_prompt 8 --rollout_batch_size 16 --micro_rollout_batch_size 32 \
  --train_batch_size 64 --micro_train_batch_size 16 \
  --generate_max_len 8 --prompt_max_len 8 \
  --actor_learning_rate 3e-3 --lr_warmup_ratio 0.05 \
  --zero_stage 2 --num_episodes 32 --max_steps 200 \
  --save_path "$out" --use_tensorboard "$out/tensorboard" \
  "$@"
