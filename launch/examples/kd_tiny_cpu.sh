#!/usr/bin/env bash
# Knowledge distillation (the OpenRLHF docs' train_kd command, scaled down): a teacher is first fine-tuned
# on the demonstrations (train_sft, OUT_DIR/teacher), then the randomly initialised embedded model learns
# from it with (1 - 0.4) x NLL + 0.4 x forward KL, the teacher offloaded between forwards. 2 CPU ranks,
# about a minute. Usage: bash launch/examples/kd_tiny_cpu.sh OUT_DIR [extra train_kd flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
common=("${cpu[@]}" --pretrain "$tiny/policy"
        --dataset "$tiny/sft.jsonl" --eval_dataset "$tiny/sft_eval.jsonl" --eval_split train
        --input_key input --output_key output --input_template "{} " --max_len 32
        --train_batch_size 32 --micro_train_batch_size 8 --learning_rate 3e-3 --lr_warmup_ratio 0.05)
"${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_sft \
  "${common[@]}" --max_epochs 2 --zero_stage 2 --save_path "$out/teacher"
exec "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_kd \
  "${common[@]}" --teacher_model "$out/teacher" --kd_coef 0.4 --teacher_offload \
  --max_epochs 1 --zero_stage 2 --eval_steps 8 \
  --save_path "$out/student" --use_tensorboard "$out/student/tensorboard" \
  "$@"
