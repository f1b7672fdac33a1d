#!/usr/bin/env bash
# DPO on the embedded copy-task preference pairs, 2 CPU ranks: the OpenRLHF docs' train_dpo command scaled down
# (fp32, sdpa, a 32-token max_len, a high learning rate for a 140k-parameter model; the embedded model stands
# in for the SFT model and is its own reference, colocated; --pretrain another one to start from it). Held-out
# preference accuracy (eval_acc: the implicit reward beta x (policy - reference log-prob) of the chosen answer
# above the rejected one's) is measured before training and at the end: 0.000 -> 0.953 after
# one epoch of 32 steps (seed 1; 0.969 at seed 2, 0.961 at seed 3), about a minute on 2 CPU cores.
# Writes the policy in HF format, metrics.jsonl and tensorboard/ into OUT_DIR.
# Usage: bash launch/examples/dpo_tiny_cpu.sh OUT_DIR [extra train_dpo flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_dpo \
  --save_path "$out" "${logged[@]}" \
  --train_batch_size 32 --micro_train_batch_size 8 \
  --pretrain "$tiny/policy" \
  --max_epochs 1 --max_len 32 --zero_stage 3 \
  --learning_rate 1e-3 --lr_warmup_ratio 0.05 --beta 0.1 \
  "${pairs[@]}" --prompt_key prompt \
  "${cpu[@]}" \
  --seed 1 \
  --use_tensorboard "$out/tensorboard" \
  "$@"
