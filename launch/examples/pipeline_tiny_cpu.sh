#!/usr/bin/env bash
# The InstructGPT recipe end to end on the embedded tiny demo, 2 CPU ranks per stage:
#   (a) SFT of the randomly initialised embedded model on the copy-task demonstrations -> OUT_DIR/sft
#       (briefly, on purpose: a partly trained policy leaves PPO something to raise);
#   (b) a reward model on the preference pairs, initialised from the SFT model -> OUT_DIR/rm;
#   (c) PPO (GAE, critic initialised from the reward model, reference model, KL penalty) of OUT_DIR/sft
#       against OUT_DIR/rm on the embedded prompts -> OUT_DIR/ppo (final policy in OUT_DIR/ppo/model).
# Each stage writes its metrics.jsonl and tensorboard/ under its own directory.
# Measured on 2 shared, busy CPU cores (load average 5-8), seed 1 unless named; about 4 minutes in all
# (SFT ~45 s, reward model ~100 s, PPO ~90 s, mostly start-up; user CPU 3m18s):
#   (a) held-out NLL 4.17 -> 2.43 after 12 steps (the full 32-step SFT example reaches 0.91);
#   (b) held-out pair accuracy 0.64 (SFT model, fresh head) -> 0.945 after 2 epochs;
#   (c) reward_mean (reward-model score normalised by its held-out mean/std), first fifth -> last fifth of 30
#       steps: PPO seed 1 0.47 -> 1.53, seed 2 0.39 -> 1.52, seed 3 0.37 -> 1.55 (it saturates near 1.55).
# The gain is reward-model over-optimisation, not a better copier: the pairs' rejected answers mostly differ
# from the chosen ones by letters, so the reward model learns "digits, not letters" (it scores "q copy 5 :
# 8 8 8 8" as high as "5 5 5 5") and PPO learns to emit 8 words, mostly digits, never </s>; the rule reward of
# reward.py (fraction of the answer's words equal to the prompt's digit) stays at 0.07-0.08 (SFT: 0.08).
# Restartable: a finished stage leaves OUT_DIR/<stage>.done (sft, rm) and a rerun skips it; PPO resumes with
# --load_checkpoint (pass it with --ckpt_path among the extra flags).
# Usage: bash launch/examples/pipeline_tiny_cpu.sh OUT_DIR [extra train_ppo flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
here=$(dirname "$0")
mkdir -p "$out"

# Runs "$@" unless OUT_DIR/$1.done exists, then writes it.
stage() {
  local name=$1
  shift
  [[ -f $out/$name.done ]] && return 0
  "$@"
  touch "$out/$name.done"
}

# (a) The SFT example, stopped after its first 12 of 32 steps (the schedule shrinks to those 12 steps).
stage sft bash "$here/sft_tiny_cpu.sh" "$out/sft" --max_steps 12 --seed 1

# (b) The reward-model example, starting from the SFT model instead of the random one.
stage rm bash "$here/rm_tiny_cpu.sh" "$out/rm" --pretrain "$out/sft"

# (c) The PPO example's algorithm, every role colocated on the 2 ranks (common.sh again: a port free now).
# shellcheck source=launch/examples/common.sh
source "$here/common.sh" "$out"
exec "${launch[@]}" --nproc_per_node 2 -m rlhf.cli.train_ppo \
  "${cpu[@]}" \
  --pretrain "$out/sft" --reward_pretrain "$out/rm" \
  --colocate_all_models \
  --advantage_estimator gae --gamma 1.0 --lambd 0.95 \
  --init_kl_coef 0.001 --kl_estimator k1 \
  --prompt_data "$tiny/prompts.jsonl" --input_key input --input_template "{} " \
  --n_samples_per_prompt 1 --rollout_batch_size 64 --micro_rollout_batch_size 32 \
  --train_batch_size 32 --micro_train_batch_size 16 --max_epochs 1 \
  --generate_max_len 8 --prompt_max_len 16 \
  --actor_learning_rate 2e-3 --critic_learning_rate 5e-3 --lr_warmup_ratio 0.05 \
  --value_clip 0.2 --eps_clip 0.2 --normalize_reward \
  --zero_stage 2 --num_episodes 20 --max_steps 30 --seed 1 \
  --save_path "$out/ppo" --use_tensorboard "$out/ppo/tensorboard" \
  "$@"
