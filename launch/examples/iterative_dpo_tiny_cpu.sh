#!/usr/bin/env bash
# Iterative DPO (RLHFlow's online DPO) on the embedded tiny demo, 2 CPU ranks per stage: OpenRLHF's
# train_iterative_dpo.sh scaled down (fp32, sdpa, 8-token answers, a high learning rate for a 140k-parameter
# model; 4 epochs instead of 1 over the ~140 pairs of an iteration). Stages, each in its own directory:
#   OUT_DIR/sft          the SFT example stopped after 12 of its 32 steps (as pipeline_tiny_cpu.sh: a partly
#                        trained policy leaves something to raise); the reference of every DPO stage, as
#                        OpenRLHF's REF_MODEL_PATH;
#   then for iteration i = 0 .. ITERS-1, with the policy of the previous iteration (iteration 0: OUT_DIR/sft):
#   OUT_DIR/iter_i/generate  batch_inference --eval_task generate_vllm --iter i: best-of-N samples of the i-th
#                        slice of the embedded prompts -> generate.jsonl;
#   OUT_DIR/iter_i/rm    batch_inference --eval_task rm --post_processor iter_dpo with the embedded reward model:
#                        the best- and worst-scored sample of each prompt as a pair -> iter_dpo.jsonl (every
#                        scored sample: iter_dpo.jsonl.scored.jsonl);
#   OUT_DIR/iter_i/dpo   train_dpo on iter_dpo.jsonl starting from the policy -> the next iteration's policy.
# OUT_DIR/rewards.jsonl has one line per iteration: the mean reward-model score ("rm_score") of all samples the
# iteration generated (its policy's score) and their rule reward (reward.py: the fraction of the first four answer
# words equal to the prompt's digit, the task the reward model stands in for).
# Measured (3 iterations): mean reward-model score of iterations 1, 2, 3 (rule reward in brackets) seed 1: 0.124
# (0.063), 0.227 (0.112), 0.462 (0.223); seed 2: 0.121 (0.063), 0.231 (0.113), 0.477 (0.204); seed 3: 0.121
# (0.059), 0.188 (0.100), 0.417 (0.192) (with --learning_rate 1e-3, seed 1: 0.124, 0.151, 0.170). About 3 minutes
# on 2 otherwise idle CPU cores (185 s), 4-5 minutes with other work on them (237-305 s at load average 3-4),
# nearly all of it the 10 stages' process and vLLM start-up.
# Restartable: OUT_DIR/iter.log counts finished iterations (as OpenRLHF's ITER_LOG_PATH), and a rerun skips
# them; within an interrupted iteration the batch_inference stages resume, the training stage starts again.
# Environment: ITERS (default 3), SEED (default 1; every stage's seed). Extra flags go to each iteration's
# train_dpo.
# Usage: bash launch/examples/iterative_dpo_tiny_cpu.sh OUT_DIR [extra train_dpo flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
# shellcheck source=launch/examples/stages.sh
source "$(dirname "$0")/stages.sh"

train() {  # POLICY DATASET SAVE_PATH: DPO on the best- against the worst-scored sample of each prompt
  "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_dpo \
    --max_len 32 \
    --dataset "$2" --dataset_probs 1.0 \
    --prompt_key prompt --chosen_key chosen --rejected_key rejected \
    --train_batch_size 32 --micro_train_batch_size 8 \
    --pretrain "$1" --ref_pretrain "$out/sft" \
    --save_path "$3" "${logged[@]}" \
    --zero_stage 3 --max_epochs 4 \
    "${cpu[@]}" \
    --learning_rate 3e-3 --lr_warmup_ratio 0.05 --beta 0.1 \
    --seed "$seed" \
    "${extra[@]}"
}

extra=("$@")
iterate "iterative DPO" 1.0 iter_dpo dpo
