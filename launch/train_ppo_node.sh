#!/usr/bin/env bash
# One node, all its GPUs (or CPU ranks): every rank hosts the actor and a vLLM engine.
#   NPROC=8 bash launch/train_ppo_node.sh --pretrain /models/Qwen2.5-7B-Instruct --prompt_data data.jsonl ...
# Any train_ppo flag may follow; NPROC defaults to the number of visible GPUs (else 2). Another job:
# JOB=train_sft (train_rm, train_prm, train_kd, train_dpo, train_kto,
#   train_simpo, train_orpo, batch_inference) bash launch/train_ppo_node.sh [its flags].
# Preemption: SIGTERM or SIGUSR1 to this script's process (kill, timeout, a scheduler) makes every rank
# finish its step, checkpoint under --ckpt_path and exit 0; GRACE_PERIOD (seconds, default 600) bounds
# the wait, after which the ranks are stopped without a checkpoint and the exit code is non-zero.
set -euo pipefail
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
port=${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
exec python -m rlhf.cli.launch --grace_period "${GRACE_PERIOD:-600}" \
  --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$port" -m "rlhf.cli.${JOB:-train_ppo}" "$@"
