#!/usr/bin/env bash
# Rejection sampling (Llama 2's best-of-N fine-tuning) on the embedded tiny demo, 2 CPU ranks per stage: OpenRLHF's
# train_rejection_sampling_llama.sh scaled down (fp32, sdpa, 8-token answers, a high learning rate for a
# 140k-parameter model; best-of-8 instead of best-of-4 and 4 epochs instead of 1 over the ~140 kept samples of an
# iteration: 1 epoch of best-of-4, 4 steps, did not raise the score). Stages, each in its own directory:
#   OUT_DIR/sft          the SFT example stopped after 12 of its 32 steps (as pipeline_tiny_cpu.sh: a partly
#                        trained policy leaves something to raise);
#   then for iteration i = 0 .. ITERS-1, with the policy of the previous iteration (iteration 0: OUT_DIR/sft):
#   OUT_DIR/iter_i/generate  batch_inference --eval_task generate_vllm --iter i: best-of-N samples of the i-th
#                        slice of the embedded prompts -> generate.jsonl;
#   OUT_DIR/iter_i/rm    batch_inference --eval_task rm --post_processor rs with the embedded reward model: the
#                        best-scored sample of each prompt -> rs.jsonl (every scored sample: rs.jsonl.scored.jsonl);
#   OUT_DIR/iter_i/sft   train_sft on rs.jsonl starting from the policy -> the next iteration's policy.
# OUT_DIR/rewards.jsonl has one line per iteration: the mean reward-model score ("rm_score") of all samples the
# iteration generated (its policy's score) and their rule reward (reward.py: the fraction of the first four answer
# words equal to the prompt's digit, the task the reward model stands in for).
# Measured (3 iterations): mean reward-model score of iterations 1, 2, 3 (rule reward in brackets) seed 1: 0.142
# (0.074), 0.219 (0.131), 0.414 (0.264); seed 2: 0.138 (0.073), 0.219 (0.123), 0.362 (0.223); seed 3: 0.136
# (0.066), 0.220 (0.128), 0.403 (0.259). About 3 minutes on 2 otherwise idle CPU cores (176 s), 4-5 minutes with
# other work on them (256-301 s at load average 3-3.5; 260-278 s on a machine about 2.5x slower, beside other tests),
# nearly all of it the 10 stages' process and vLLM start-up.
# Restartable: OUT_DIR/iter.log counts finished iterations (as OpenRLHF's ITER_LOG_PATH), and a rerun skips
# them; within an interrupted iteration the batch_inference stages resume, the training stage starts again.
# Environment: ITERS (default 3), SEED (default 1; every stage's seed). Extra flags go to each iteration's
# train_sft.
# Usage: bash launch/examples/rejection_sampling_tiny_cpu.sh OUT_DIR [extra train_sft flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
# shellcheck source=launch/examples/stages.sh
source "$(dirname "$0")/stages.sh"

train() {  # POLICY DATASET SAVE_PATH: SFT on the best-scored sample of each prompt
  "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_sft \
    --max_len 32 \
    --dataset "$2" --dataset_probs 1.0 --input_key input --output_key output --input_template "{}" \
    --train_batch_size 32 --micro_train_batch_size 8 \
    --pretrain "$1" \
    --save_path "$3" "${logged[@]}" \
    --zero_stage 2 --max_epochs 4 \
    "${cpu[@]}" \
    --learning_rate 3e-3 --lr_warmup_ratio 0.05 \
    --seed "$seed" \
    "${extra[@]}"
}

extra=("$@")
iterate "rejection sampling" 0.9 rs sft
