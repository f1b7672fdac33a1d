"""The train_ppo_ray commands of OpenRLHF v0.9.5's example scripts (examples/scripts/*.sh of that tag), with every
flag verbatim, and their replay at tiny scale: model and data paths pointed at the embedded demo, sizes shrunk."""

import json

from rlhf.assets import TINY_DIR

PPO_HYBRID_ENGINE = """
   --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
   --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
   --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5
   --pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k
   --save_path /openrlhf/examples/test_scripts/final/llama3-8b-rlhf
   --ckpt_path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf --save_hf_ckpt
   --train_batch_size 128 --rollout_batch_size 1024 --n_samples_per_prompt 1 --max_epochs 1
   --prompt_max_len 1024 --max_samples 100000 --generate_max_len 1024 --zero_stage 3 --param_dtype bf16
   --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01
   --prompt_data OpenRLHF/prompt-collection-v0.1 --input_key context_messages --apply_chat_template
   --normalize_reward --gradient_checkpointing --packing_samples --vllm_sync_backend nccl --enforce_eager
   --vllm_enable_sleep --deepspeed_enable_sleep --use_dynamic_batch --train_max_tokens_per_gpu 16384
   --enable_vllm_is_correction
""".split()

PPO_WITH_REWARD_FN = """
   --ref_num_nodes 1 --ref_num_gpus_per_node 2 --critic_num_nodes 1 --critic_num_gpus_per_node 2
   --actor_num_nodes 1 --actor_num_gpus_per_node 2 --vllm_num_engines 2 --vllm_tensor_parallel_size 2
   --colocate_actor_ref --pretrain OpenRLHF/Llama-3-8b-sft-mixture
   --remote_rm_url /openrlhf/examples/python/reward_func.py
   --save_path /openrlhf/examples/checkpoint/llama3-8b-rlhf --micro_train_batch_size 8 --train_batch_size 128
   --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_samples 100000 --max_epochs 1
   --prompt_max_len 1024 --generate_max_len 1024 --zero_stage 3 --param_dtype bf16 --actor_learning_rate 5e-7
   --critic_learning_rate 9e-6 --init_kl_coef 0.01 --prompt_data OpenRLHF/prompt-collection-v0.1
   --input_key context_messages --apply_chat_template --normalize_reward --packing_samples --adam_offload
   --attn_implementation flash_attention_2 --gradient_checkpointing
""".split()

# train_dapo_ray_hybrid_engine.sh ends with `--vllm_enable_is_correction`, a misspelling that OpenRLHF's
# own parser rejects too; the replay uses the flag it means, --enable_vllm_is_correction.
DAPO = """
   --ref_num_nodes 1 --ref_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
   --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.6
   --init_kl_coef 1e-3 --gamma 1.0 --use_kl_loss --kl_estimator k3 --advantage_estimator group_norm
   --dynamic_filtering --dynamic_filtering_reward_range 0 1 --eps_clip_low_high 0.2 0.27
   --pretrain OpenRLHF/Llama-3-8b-sft-mixture --remote_rm_url /openrlhf/examples/python/reward_func.py
   --save_path /openrlhf/examples/test_scripts/final/llama3-8b-rlhf
   --ckpt_path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf --save_steps 20 --save_hf_ckpt
   --micro_train_batch_size 8 --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 128
   --n_samples_per_prompt 8 --max_epochs 1 --prompt_max_len 1024 --max_samples 20000 --generate_max_len 1024
   --zero_stage 3 --param_dtype bf16 --actor_learning_rate 5e-7 --prompt_data OpenRLHF/prompt-collection-v0.1
   --input_key context_messages --apply_chat_template --gradient_checkpointing --packing_samples
   --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep --deepspeed_enable_sleep
   --enable_vllm_is_correction
""".split()

TINY_SIZES = {"--train_batch_size": "8", "--rollout_batch_size": "8", "--micro_train_batch_size": "2",
              "--micro_rollout_batch_size": "4", "--prompt_max_len": "32", "--generate_max_len": "8",
              "--vllm_tensor_parallel_size": "1", "--actor_num_gpus_per_node": "1", "--ref_num_gpus_per_node": "1",
              "--critic_num_gpus_per_node": "1", "--reward_num_gpus_per_node": "1"}


def at_tiny_scale(argv: list[str], tmp_path) -> list[str]:
    """`argv` with model and data paths pointing at the embedded demo and sizes shrunk; nothing else changes."""
    prompts = tmp_path / "prompt-collection.jsonl"
    with open(f"{TINY_DIR}/prompts.jsonl") as src, open(prompts, "w") as dst:
        for line in src:
            row = json.loads(line)
            dst.write(json.dumps({"context_messages": [{"role": "user", "content": row["input"]}],
                                  "label": row["label"]}) + "\n")
    paths = {"--pretrain": f"{TINY_DIR}/policy", "--reward_pretrain": f"{TINY_DIR}/reward_model",
             "--remote_rm_url": f"{TINY_DIR}/reward.py", "--prompt_data": str(prompts),
             "--save_path": str(tmp_path / "save"), "--ckpt_path": str(tmp_path / "ckpt")}
    out = list(argv)
    for i, token in enumerate(out[:-1]):
        if token in paths or token in TINY_SIZES:
            out[i + 1] = paths.get(token) or TINY_SIZES[token]
    return out
