#!/usr/bin/env bash
# Process reward model (the OpenRLHF docs' train_prm command, scaled down): the embedded tiny model learns
# to mark each step of a copy-task answer good (w1) or bad (w2) at the placeholder token w0 after it.
# 2 CPU ranks, ZeRO-3 with gradient checkpointing and packing as in the OpenRLHF example, under a minute.
# Usage: bash launch/examples/prm_tiny_cpu.sh OUT_DIR [extra train_prm flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_prm \
  "${cpu[@]}" \
  --pretrain "$tiny/policy" \
  --dataset "$tiny/prm.jsonl" --eval_dataset "$tiny/prm_eval.jsonl" --eval_split train \
  --input_key input --label_key label --placeholder_token w0 --reward_tokens w1 w2 \
  --train_batch_size 32 --micro_train_batch_size 8 --max_epochs 2 --max_len 32 \
  --zero_stage 3 --gradient_checkpointing --packing_samples \
  --learning_rate 3e-3 --lr_warmup_ratio 0.05 --eval_steps 16 \
  --save_path "$out" --use_tensorboard "$out/tensorboard" \
  "$@"
