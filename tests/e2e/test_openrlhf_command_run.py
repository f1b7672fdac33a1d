"""The train_ppo_ray commands of OpenRLHF v0.9.5's example scripts (examples/scripts/*.sh of that tag),
replayed with every flag verbatim except model and data paths and sizes (batch sizes, lengths, GPU
counts): they parse into the config the script means, and the hybrid-engine PPO command trains end to
end at tiny scale on 2 CPU ranks."""

import json

import pytest

from rlhf.assets import TINY_DIR
from tests.distributed import run_torchrun
from tests.tiny_runs import read_metrics

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


@pytest.mark.vllm
def test_openrlhf_hybrid_engine_ppo_command_trains_at_tiny_scale(tmp_path):
    pytest.importorskip("vllm")
    argv = at_tiny_scale(PPO_HYBRID_ENGINE, tmp_path)
    proc = run_torchrun(2, "-m rlhf.cli.train_ppo", *argv, "--max_steps", "2")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "algorithm: --advantage_estimator gae, 1 sample per prompt, KL k1 x 0.01 (fixed) in the reward" \
        in proc.stdout
    rows = read_metrics(tmp_path / "save")
    assert [r["step"] for r in rows] == [1, 2]
    # before the first update the policy is its reference, and --normalize_reward's running moments hold only
    # this batch: the KL is exactly 0 and the shaped rewards have mean 0; GAE advantages are whitened
    assert rows[0]["kl"] == 0.0 and abs(rows[0]["reward_shaped_mean"]) < 1e-6
    assert all(abs(r["advantage_mean"]) < 1e-6 and r["value_loss"] > 0 for r in rows)
    # the cosine schedule with its 0.1 x lr floor over the 2 steps (OpenRLHF's cosine_with_min_lr)
    assert [r["lr"] for r in rows] == pytest.approx([5e-7, 5e-8])
    # bf16 engine and actor agree to bf16 rounding, so the correction's weights stay near 1
    assert all(r["rollout/logprob_abs_diff"] < 5e-3 and abs(r["rollout/is_weight_mean"] - 1) < 5e-3 for r in rows)
