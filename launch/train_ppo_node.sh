#!/usr/bin/env bash
# One node, all its GPUs (or CPU ranks): every rank hosts the actor and a vLLM engine.
#   NPROC=8 bash launch/train_ppo_node.sh --pretrain /models/Qwen2.5-7B-Instruct --prompt_data data.jsonl ...
# Any train_ppo flag may follow; NPROC defaults to the number of visible GPUs (else 2).
set -euo pipefail
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
port=${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
exec torchrun --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$port" -m rlhf.cli.train_ppo "$@"
