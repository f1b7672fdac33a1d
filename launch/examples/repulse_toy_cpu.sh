#!/usr/bin/env bash
# The RePULSe paper's toy on CPU: one prompt ("copy :"), 2-word responses, no KL, the embedded tiny policy and
# the toy reward (rlhf/assets/toy/reward.py: -5 for a response with a bad word x, y or z, else the fraction
# of its words that are digits). Four methods at the same sample budget (3200 responses; RePULSe spends half
# of it on its proposal q), seeds 1-3, then the figure:
#   REINFORCE               --harmlessness_training_loss_type reinforce --alpha 0
#   REINFORCE, transformed  the same with --reward_transform minus_alpha_exp_beta_r (r - 0.1 exp(-r))
#   base as proposal        --use_base_as_proposal --alpha 1 (negatives: p's own samples, weights softmax(-r))
#   RePULSe                 --alpha 1 --target_dist_beta -1 (q learns sigma ∝ p exp(-r) by CTL)
# The exact log P(bad) and expected reward are logged after every fit step (--analytic_bad_word_calc).
# Writes OUT_DIR/<method>_s<seed>/ (metrics.jsonl, model, proposal) and OUT_DIR/figures/ (training_curves.png,
# frontier.png, summary.json). Two runs at a time; about 5-10 minutes on 2 CPU cores.
# Usage: bash launch/examples/repulse_toy_cpu.sh OUT_DIR [extra train_repulse flags for every run...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
toy=$(python -c 'from rlhf.assets import TOY_DIR; print(TOY_DIR)')
seeds=${REPULSE_TOY_SEEDS:-"1 2 3"}
fit_steps=10
episodes=20  # per fit step for RePULSe (2 x 8 samples per step); the one-model methods run twice as many steps

run() {  # run NAME SEED EPISODES FLAGS...
  local name=$1 seed=$2 episodes=$3 port
  shift 3
  port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local launcher=("${launch[@]}")
  launcher[${#launcher[@]}-1]=$port  # two runs at a time: a port each
  "${launcher[@]}" --nproc_per_node 1 -m rlhf.cli.train_repulse \
    --pretrain "$tiny/policy" --remote_rm_url "$toy/reward.py" \
    --new_custom_single_prompt --custom_prompt "copy :" --input_template "{} " \
    --do_harmlessness_training --duplicate_rollout_batch_by 8 --n_samples_per_prompt 1 \
    --harmlessness_training_loss_type neg_training --reinforce_baseline_type expectation \
    --actor_loss_type ctl --parameterization policy_psi_q_p_s_t \
    --rollout_batch_size 1 --train_batch_size 8 --micro_train_batch_size 8 \
    --generate_max_len 2 --prompt_max_len 8 --init_kl_coef 0 \
    --fit_steps "$fit_steps" --harmlessness_training_num_episodes "$episodes" \
    --analytic_bad_word_calc --bad_words "x y z" \
    --lr_scheduler constant --lr_warmup_ratio 0 --adam_betas 0.9 0.999 \
    --param_dtype fp32 --attn_implementation sdpa --rollout_engine hf --zero_stage 2 \
    --base_actor_learning_rate 1e-3 --save_path "$out/${name}_s$seed" --save_steps -1 --seed "$seed" \
    "$@" "${extra[@]}" > "$out/${name}_s$seed.log" 2>&1 || { echo "run $name seed $seed failed:"; tail -20 "$out/${name}_s$seed.log"; exit 1; }
  echo "done: $name seed $seed"
}
extra=("$@")
mkdir -p "$out"
for seed in $seeds; do
  run reinforce "$seed" $((2 * episodes)) --harmlessness_training_loss_type reinforce --alpha 0 &
  run reinforce_transformed "$seed" $((2 * episodes)) --harmlessness_training_loss_type reinforce --alpha 0 \
    --reward_transform minus_alpha_exp_beta_r --rew_trans_alpha 0.1 --rew_trans_beta -1 &
  wait
  run base_as_proposal "$seed" $((2 * episodes)) --use_base_as_proposal --alpha 1 --target_dist_beta -1 &
  run repulse "$seed" "$episodes" --alpha 1 --target_dist_beta -1 --actor_learning_rate 1e-3 &
  wait
done
runs() { local dirs=(); for seed in $seeds; do dirs+=("$out/$1_s$seed"); done; (IFS=,; echo "$2=${dirs[*]}"); }
python -m rlhf.cli.plot_repulse --out "$out/figures" --title "RePULSe toy: one prompt, 2-word responses" \
  --runs "$(runs reinforce REINFORCE)" "$(runs reinforce_transformed "REINFORCE, r - 0.1 exp(-r)")" \
  "$(runs base_as_proposal "base as proposal")" "$(runs repulse RePULSe)"
