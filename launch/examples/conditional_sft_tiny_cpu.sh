#!/usr/bin/env bash
# Conditional SFT (SteerLM-style: the reward written into the prompt, the highest one asked for at generation) on
# the embedded tiny demo, 2 CPU ranks per stage: OpenRLHF's train_conditional.sh scaled down (fp32, sdpa, 8-token
# answers, a high learning rate for a 140k-parameter model), followed by the generation it trains for. Stages,
# each in its own directory:
#   OUT_DIR/sft          the SFT example stopped after 12 of its 32 steps (as pipeline_tiny_cpu.sh);
#   OUT_DIR/data         the answers of the embedded preference pairs, chosen and rejected, as {prompt, output}
#                        rows (OpenRLHF scores a preference data set's chosen answers; the tiny pairs' chosen
#                        answers are mostly good, so the rejected ones are added for the reward to vary);
#   OUT_DIR/rm           batch_inference --eval_task rm --post_processor csft --normalize_reward with the embedded
#                        reward model: each answer with its standardised reward written after the prompt by
#                        --reward_template -> csft.jsonl;
#   OUT_DIR/condition    the reward in each prompt replaced by its decile as a word, w0 (lowest) .. w9 (highest):
#                        the demo's word-level tokenizer has no token for "-0.12" or "<rm_score>:" (each reads as
#                        <unk>, so every condition would look the same), and SteerLM conditions on 0-9 levels too;
#   OUT_DIR/csft         train_sft on those rows starting from the SFT policy (as OpenRLHF starts from its SFT model);
#   OUT_DIR/generate, OUT_DIR/rm_sft   batch_inference --eval_task generate_vllm: 4 samples of every embedded
#                        prompt from the SFT policy, scored by the reward model;
#   OUT_DIR/generate_wN, OUT_DIR/rm_wN   the same from the conditional policy with --enable_csft --csft_prompt wN,
#                        the highest condition (w9) and, for contrast, the lowest (w0).
# OUT_DIR/rewards.jsonl: the mean reward-model score ("rm_score") and rule reward (fraction of the first four
# answer words equal to the prompt's digit) of the SFT policy's samples ("sft_policy") and of the conditional
# policy's under each condition ("csft_w9", "csft_w0").
# Measured: mean reward-model score (rule reward in brackets) of the SFT policy, the conditional policy under w9,
# under w0: seed 1: 0.120 (0.066), 0.413 (0.502), 0.181 (0.195); seed 2: 0.119 (0.063), 0.535 (0.654), 0.065
# (0.075); seed 3: 0.120 (0.064), 0.507 (0.610), 0.118 (0.141). Part of the gain over the SFT policy is more SFT
# on mostly good answers; the gap between w9 and w0, the same policy asked for different rewards, is the
# conditioning's. (Scoring the SFT policy's own samples instead of the pairs' answers, 2 epochs: w9 0.098 against
# the SFT policy's 0.120; the barely trained policy's samples are near-random words, too noisy to learn the
# condition from.) About 2.5 minutes on 2 otherwise idle CPU cores (152 s), 4-5 minutes with other work on them
# (224-272 s at load average 3-3.5; 235-274 s on a machine about 2.5x slower, beside other tests), nearly all of it
# the 9 stages' process and vLLM start-up.
# Restartable: a finished stage leaves OUT_DIR/<stage>.done (batch_inference stages also resume mid-way) and a
# rerun skips it. Environment: SEED (default 1; every stage's seed). Extra flags go to the train_sft of csft.
# Usage: bash launch/examples/conditional_sft_tiny_cpu.sh OUT_DIR [extra train_sft flags...]
set -euo pipefail
# shellcheck source=launch/examples/common.sh
source "$(dirname "$0")/common.sh"
shift
# shellcheck source=launch/examples/stages.sh
source "$(dirname "$0")/stages.sh"
mkdir -p "$out/data" "$out/condition"

# Runs "$@" unless OUT_DIR/$1.done exists, then writes it; with a port free now (common.sh).
stage() {
  local name=$1
  shift
  [[ -f $out/$name.done ]] && return 0
  # shellcheck source=launch/examples/common.sh
  source "$here/common.sh" "$out"
  "$@"
  touch "$out/$name.done"
}

stage sft bash "$here/sft_tiny_cpu.sh" "$out/sft" --max_steps 12 --seed "$seed"

stage data python - "$tiny/pairs.jsonl" "$out/data/answers.jsonl" <<'PY'
import json, sys
from rlhf.inference.output import write_atomically
pairs = [json.loads(line) for line in open(sys.argv[1])]
rows = [{"prompt": p["prompt"], "output": p[key]} for p in pairs for key in ("chosen", "rejected")]
write_atomically(sys.argv[2], "".join(json.dumps(r) + "\n" for r in rows))
PY

stage rm score "$out/data/answers.jsonl" "$out/rm/csft.jsonl" --input_key prompt --output_key output \
  --input_template "{} " --post_processor csft --normalize_reward --reward_template "{input}{reward} "

stage condition python - "$out/rm/csft.jsonl" "$out/condition/csft.jsonl" <<'PY'
import bisect, json, sys
from rlhf.inference.output import write_atomically
rows = [json.loads(line) for line in open(sys.argv[1])]
ranked = sorted(r["reward"] for r in rows)
edges = [ranked[len(ranked) * k // 10] for k in range(1, 10)]  # decile boundaries
for row in rows:
    written = f"{row['reward']:.2f} "  # what --reward_template "{input}{reward} " appended
    assert row["input"].endswith(written), row
    row["input"] = row["input"][: -len(written)] + f"w{bisect.bisect_right(edges, row['reward'])} "
write_atomically(sys.argv[2], "".join(json.dumps(r) + "\n" for r in rows))
PY

stage csft launched --nproc_per_node 2 -m rlhf.cli.train_sft \
  --max_len 32 \
  --dataset "$out/condition/csft.jsonl" --dataset_probs 1.0 \
  --input_key input --output_key output --input_template "{}" \
  --train_batch_size 32 --micro_train_batch_size 8 \
  --pretrain "$out/sft" \
  --save_path "$out/csft" "${logged[@]}" \
  --zero_stage 2 --max_epochs 1 \
  "${cpu[@]}" \
  --learning_rate 3e-3 --lr_warmup_ratio 0.05 \
  --seed "$seed" \
  "$@"

stage generate generate "$out/sft" "$out/generate/generate.jsonl" --temperature 1.0 --best_of_n 4
stage rm_sft score "$out/generate/generate.jsonl" "$out/rm_sft/scored.jsonl"
for level in w9 w0; do
  stage "generate_$level" generate "$out/csft" "$out/generate_$level/generate.jsonl" --temperature 1.0 --best_of_n 4 \
    --enable_csft --csft_prompt "$level"
  stage "rm_$level" score "$out/generate_$level/generate.jsonl" "$out/rm_$level/scored.jsonl"
done

python -m rlhf.inference.summary "$out/rewards.jsonl" "sft_policy=$out/rm_sft/scored.jsonl" \
  "csft_w9=$out/rm_w9/scored.jsonl" "csft_w0=$out/rm_w0/scored.jsonl"
