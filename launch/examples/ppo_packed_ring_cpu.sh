#!/usr/bin/env bash
# The PPO example (ppo_tiny_cpu.sh) with the long-context machinery on: packed samples, token-budget
# micro-batches and ring attention; each role's 2 ranks form one ring (data-parallel size 1 per role).
# Usage: bash launch/examples/ppo_packed_ring_cpu.sh OUT_DIR [extra train_ppo flags...]
set -euo pipefail
exec bash "$(dirname "$0")/ppo_tiny_cpu.sh" "$@" \
  --packing_samples --use_dynamic_batch --ring_attn_size 2 \
  --train_max_tokens_per_gpu 96 --rollout_max_tokens_per_gpu 192
