#!/usr/bin/env bash
# Reward-model training on the embedded copy-task preference pairs, 2 CPU ranks: the OpenRLHF docs' train_rm
# command scaled down (fp32, sdpa, a 32-token max_len, a high learning rate for a 140k-parameter model; the
# embedded model stands in for the SFT model, --pretrain another one to start from it). Held-out accuracy
# (eval_acc) is measured before training and at the end: 0.43 -> 0.938 (seed 1; 0.945 at seeds 2 and 3; one
# epoch ends at 0.85-0.95), 25-60 s on 2 CPU cores. --packing_samples and --gradient_checkpointing are left
# out as in sft_tiny_cpu.sh. Writes a sequence-classification checkpoint (held-out reward mean/std in its
# config.json), metrics.jsonl and tensorboard/ into OUT_DIR.
# Usage: bash launch/examples/rm_tiny_cpu.sh OUT_DIR [extra train_rm flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
exec "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_rm \
  --save_path "$out" "${logged[@]}" \
  --train_batch_size 32 --micro_train_batch_size 8 \
  --pretrain "$tiny/policy" \
  --max_epochs 2 --max_len 32 --zero_stage 3 \
  --learning_rate 3e-3 --lr_warmup_ratio 0.05 \
  "${pairs[@]}" --prompt_key prompt \
  "${cpu[@]}" \
  --seed 1 \
  --use_tensorboard "$out/tensorboard" \
  "$@"
