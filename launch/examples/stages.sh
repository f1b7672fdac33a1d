# Sourced by the multi-stage examples (rejection sampling, iterative DPO, conditional SFT): their generation and
# scoring stages on the embedded demo, and the iteration loop of the first two. Source it after common.sh; it sets
# $here (this folder) and $seed (SEED, default 1: every stage's seed). Each stage starts with common.sh again (a
# port free now).
# The generation stage runs vLLM eagerly (--enforce_eager): it makes one generate call, and compiling costs more
# start-up than such a call saves (benchmarks/README.md, "vLLM on CPU: compiled or eager").
here=$(dirname "${BASH_SOURCE[0]}")
seed=${SEED:-1}
mkdir -p "$out"

# launched FLAGS...: the launcher at the port common.sh chose last (a function: a stage that sources common.sh
# before running it gets the new port).
launched() { "${launch[@]}" "$@"; }

# generate POLICY OUTPUT_PATH [batch_inference flags...]: samples of the embedded prompts (8-token answers; give
# --best_of_n, --temperature and the prompt slice).
generate() {
  local policy=$1 output=$2
  shift 2
  # shellcheck source=launch/examples/common.sh
  source "$here/common.sh" "$out"
  launched --nproc_per_node 2 -m rlhf.cli.batch_inference \
    --eval_task generate_vllm "${cpu[@]}" --zero_stage 0 --enforce_eager \
    --pretrain "$policy" --dataset "$tiny/prompts.jsonl" --input_key input --input_template "{} " \
    --max_new_tokens 8 --prompt_max_len 16 --tp_size 1 --seed "$seed" --output_path "$output" "$@"
}

# score DATASET OUTPUT_PATH [batch_inference flags...]: DATASET's rows scored by the embedded reward model (give the
# --post_processor, if any).
score() {
  local dataset=$1 output=$2
  shift 2
  # shellcheck source=launch/examples/common.sh
  source "$here/common.sh" "$out"
  launched --nproc_per_node 2 -m rlhf.cli.batch_inference \
    --eval_task rm "${cpu[@]}" --zero_stage 0 \
    --pretrain "$tiny/reward_model" --max_len 32 \
    --dataset "$dataset" --dataset_probs 1.0 --micro_batch_size 64 \
    --output_path "$output" "$@"
}

# iterate NAME TEMPERATURE POST_PROCESSOR TRAINED: OpenRLHF's iteration loop. First the SFT example stopped after 12
# of its 32 steps (OUT_DIR/sft, the first policy), then for i = 0 .. ITERS-1 (default 3): best-of-8 samples of the
# i-th slice of the prompts from the policy (OUT_DIR/iter_i/generate), scored with POST_PROCESSOR (OUT_DIR/iter_i/rm),
# and the caller's `train POLICY DATASET SAVE_PATH` on the result into OUT_DIR/iter_i/TRAINED, the next policy.
# OUT_DIR/iter.log counts finished iterations (as OpenRLHF's ITER_LOG_PATH) and a rerun skips them; then the
# summary of every iteration's scored samples (OUT_DIR/rewards.jsonl).
iterate() {
  local name=$1 temperature=$2 processor=$3 trained=$4 iters=${ITERS:-3} policy i dir stages=()
  if [[ ! -f $out/iter.log ]]; then
    bash "$here/sft_tiny_cpu.sh" "$out/sft" --max_steps 12 --seed "$seed"
    echo 0 > "$out/iter.log"
  fi
  policy=$out/sft
  for ((i = 0; i < iters; i++)); do
    dir=$out/iter_$i
    if ((i >= $(cat "$out/iter.log"))); then
      echo "$name: iteration $i of $iters, policy $policy"
      # each iteration generates for new prompts, as OpenRLHF's --iter slices
      generate "$policy" "$dir/generate/generate.jsonl" --temperature "$temperature" --best_of_n 8 \
        --iter "$i" --rollout_batch_size $((512 / iters))
      score "$dir/generate/generate.jsonl" "$dir/rm/$processor.jsonl" --post_processor "$processor"
      # shellcheck source=launch/examples/common.sh
      source "$here/common.sh" "$out"
      train "$policy" "$dir/rm/$processor.jsonl" "$dir/$trained"
      echo $((i + 1)) > "$out/iter.log"
    fi
    policy=$dir/$trained
    stages+=("iter_$i=$dir/rm/$processor.jsonl.scored.jsonl")
  done
  python -m rlhf.inference.summary "$out/rewards.jsonl" "${stages[@]}"
  echo "final policy: $policy"
}
