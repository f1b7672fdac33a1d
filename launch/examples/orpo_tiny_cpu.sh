#!/usr/bin/env bash
# ORPO (Hong et al. 2024; reference-free: the chosen answers' NLL plus lambda x the log odds-ratio loss, no
# reference model) on the embedded copy-task preference pairs, 2 CPU ranks, with the paper's lambda 0.1 (fp32,
# sdpa, a 32-token max_len, a high learning rate for a 140k-parameter model; --pretrain another model to start
# from it). Held-out preference accuracy (eval_acc: the chosen answer's average log-prob above the rejected
# one's) before training and at the end: 0.531 -> 0.977 after one epoch of 32 steps (seed 1; 0.984 at
# seed 2, 0.977 at seed 3), under a minute on 2 CPU cores.
# Writes the policy in HF format, metrics.jsonl and tensorboard/ into OUT_DIR.
# Usage: bash launch/examples/orpo_tiny_cpu.sh OUT_DIR [extra train_orpo flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_orpo \
  --save_path "$out" "${logged[@]}" \
  --train_batch_size 32 --micro_train_batch_size 8 \
  --pretrain "$tiny/policy" \
  --max_epochs 1 --max_len 32 --zero_stage 2 \
  --learning_rate 1e-3 --lr_warmup_ratio 0.05 --orpo_lambda 0.1 \
  "${pairs[@]}" --prompt_key prompt \
  "${cpu[@]}" \
  --seed 1 \
  --use_tensorboard "$out/tensorboard" \
  "$@"
