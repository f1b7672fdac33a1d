# Sourced by the iterative pipeline examples (rejection sampling, iterative DPO): one iteration's generation and
# scoring stages. Needs $here, $out, $tiny, $cpu, $seed and $rollout_batch_size from the caller.
# The generation stage runs vLLM eagerly (--enforce_eager): it makes one generate call, and compiling costs more
# start-up than such a call saves (benchmarks/README.md, "vLLM on CPU: compiled or eager").
# Usage: generate_and_score POLICY DIR ITER TEMPERATURE POST_PROCESSOR
#   -> DIR/generate/generate.jsonl (best-of-8 samples of the ITER-th prompt slice) and
#      DIR/rm/POST_PROCESSOR.jsonl (scored with the embedded reward model; every scored row in
#      DIR/rm/POST_PROCESSOR.jsonl.scored.jsonl).
generate_and_score() {
  local policy=$1 dir=$2 i=$3 temperature=$4 processor=$5
  # common.sh again before each stage: a port free now
  # shellcheck source=launch/examples/common.sh
  source "$here/common.sh" "$out"
  python -m rlhf.cli.launch --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port" -m rlhf.cli.batch_inference \
    --eval_task generate_vllm "${cpu[@]}" --zero_stage 0 --enforce_eager \
    --pretrain "$policy" --dataset "$tiny/prompts.jsonl" --input_key input --input_template "{} " \
    --max_new_tokens 8 --prompt_max_len 16 --temperature "$temperature" --best_of_n 8 \
    --tp_size 1 --iter "$i" --rollout_batch_size "$rollout_batch_size" --seed "$seed" \
    --output_path "$dir/generate/generate.jsonl"

  # shellcheck source=launch/examples/common.sh
  source "$here/common.sh" "$out"
  python -m rlhf.cli.launch --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port" -m rlhf.cli.batch_inference \
    --eval_task rm "${cpu[@]}" --zero_stage 0 \
    --pretrain "$tiny/reward_model" --max_len 32 \
    --dataset "$dir/generate/generate.jsonl" --dataset_probs 1.0 \
    --post_processor "$processor" --micro_batch_size 64 \
    --output_path "$dir/rm/$processor.jsonl"
  # shellcheck source=launch/examples/common.sh
  source "$here/common.sh" "$out"
}
