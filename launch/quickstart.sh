#!/usr/bin/env bash
# GRPO on the embedded tiny demo (policy, prompts and reward ship with the package): 2 CPU ranks,
# a few minutes. Usage: bash launch/quickstart.sh OUT_DIR [extra train_ppo flags...]
set -euo pipefail
out=${1:?usage: bash launch/quickstart.sh OUT_DIR [extra flags]}
shift
nproc=${NPROC:-2}
port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# rlhf.cli.launch is torchrun plus preemption: SIGTERM/SIGUSR1 to this process make the workers finish
# the step, checkpoint under --ckpt_path and exit 0, within --grace_period seconds.
exec python -m rlhf.cli.launch --grace_period "${GRACE_PERIOD:-600}" \
  --nproc_per_node "$nproc" --master_addr 127.0.0.1 --master_port "$port" \
  -m rlhf.cli.train_ppo \
  --param_dtype fp32 --attn_implementation sdpa \
  --advantage_estimator group_norm --init_kl_coef 0 \
  --n_samples_per_prompt 8 \
  --rollout_batch_size 16 \
  --micro_rollout_batch_size 64 \
  --train_batch_size 64 \
  --micro_train_batch_size 32 \
  --generate_max_len 8 \
  --prompt_max_len 16 \
  --label_key label \
  --actor_learning_rate 3e-3 \
  --lr_warmup_ratio 0.05 \
  --num_episodes 8 \
  --max_steps 120 \
  --zero_stage 2 \
  --save_path "$out" \
  --use_tensorboard "$out/tensorboard" \
  "$@"
