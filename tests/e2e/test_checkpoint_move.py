"""A checkpoint moves with the job: a PPO run (actor and critic) resumed at another world size, ZeRO stage and
placement, and a DPO run resumed on another number of ranks at another stage, continue the uninterrupted run's
steps (the same samples and metrics to float tolerance, the weights within AdamW's rounding bound), with no
conversion step: the states go through DeepSpeed's universal form on load (`rlhf.engines.portable_state`)."""

import os

import pytest
from safetensors.torch import load_file

from rlhf.assets import TINY_DIR
from tests.distributed import run_job_variants
from tests.tiny_runs import EAGER, TRAIN, assert_adam_weights_close, read_metrics

PPO = [*TRAIN, *EAGER, "--pretrain", f"{TINY_DIR}/policy", "--reward_pretrain", f"{TINY_DIR}/reward_model",
       "--prompt_data", f"{TINY_DIR}/prompts.jsonl", "--advantage_estimator", "gae", "--n_samples_per_prompt", "1",
       "--rollout_batch_size", "8", "--micro_rollout_batch_size", "4", "--train_batch_size", "4",
       "--micro_train_batch_size", "2", "--generate_max_len", "6", "--prompt_max_len", "16",
       "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--lr_scheduler", "constant",
       "--seed", "5", "--ptx_coef", "0.1", "--pretrain_data", f"{TINY_DIR}/prompts.jsonl"]
SPLIT = ["--actor_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1",
         "--reward_num_gpus_per_node", "1", "--colocate_actor_ref", "--colocate_critic_reward"]
COMPARED = ("reward_mean", "response_length", "kl", "policy_loss", "value_loss", "ptx_loss", "grad_norm", "lr")


def expected_ids(steps_done: int) -> str:
    """The prompt ids of the step after `steps_done`, as the resume line lists them: the global prompt order of
    --seed 5 and --rollout_batch_size 8 over the prompt file, whatever the world size."""
    from rlhf.data.prompts import PromptSampler

    with open(f"{TINY_DIR}/prompts.jsonl") as f:
        count = sum(1 for line in f if line.strip())
    ids = PromptSampler([None] * count, 8, 5).batch_ids(steps_done)
    print(f"step {steps_done + 1}: prompts {ids}")
    return ", ".join(map(str, ids))


def ppo_results(out):
    return (read_metrics(out), load_file(os.path.join(out, "model", "model.safetensors")),
            load_file(os.path.join(out, "critic", "model.safetensors")))


@pytest.mark.vllm
def test_ppo_resumes_at_another_world_size_stage_and_placement(tmp_path):
    """2 ranks colocated at ZeRO-2 (steps 1-2) -> 1 rank at ZeRO-3 (steps 3-4) -> 2 ranks with actor and critic
    on ranks of their own at ZeRO-2 (steps 5-6), against 6 straight steps on 2 colocated ranks at ZeRO-2."""
    pytest.importorskip("vllm")
    ckpt, moved, straight = str(tmp_path / "ckpt"), tmp_path / "moved", tmp_path / "straight"
    run_job_variants(2, [("train_ppo", [*PPO, "--max_steps", "6", "--zero_stage", "2", "--save_path", str(straight)]),
                         ("train_ppo", [*PPO, "--max_steps", "2", "--zero_stage", "2", "--save_path", str(moved),
                                        "--ckpt_path", ckpt, "--save_steps", "2"])],
                     tmp_path / "consoles-a", straight, moved)
    resume = ["--load_checkpoint", "--ckpt_path", ckpt, "--save_steps", "2", "--save_path", str(moved)]
    to_one, = run_job_variants(1, [("train_ppo", [*PPO, "--max_steps", "4", "--zero_stage", "3", *resume])],
                               tmp_path / "consoles-b", moved)
    assert "the actor's state moved from ZeRO-2 over 2 ranks to ZeRO-3 over 1 rank" in to_one
    assert "the critic's state moved from ZeRO-2 over 2 ranks to ZeRO-3 over 1 rank" in to_one
    assert "the run moved from 2 ranks to 1" in to_one
    assert f"after 2 steps; step 3 trains on samples {expected_ids(2)}" in to_one  # the straight run's step 3
    to_split, = run_job_variants(2, [("train_ppo", [*PPO, "--max_steps", "6", "--zero_stage", "2", *SPLIT,
                                                    *resume])],
                                 tmp_path / "consoles-c", moved)
    assert "the actor's state moved from ZeRO-3 over 1 rank to ZeRO-2 over 1 rank" in to_split
    assert f"after 4 steps; step 5 trains on samples {expected_ids(4)}" in to_split
    (ref_metrics, ref_actor, ref_critic), (metrics, actor, critic) = ppo_results(straight), ppo_results(moved)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(ref_metrics, metrics):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
    assert_adam_weights_close(ref_actor, actor, lr=1e-3, steps=4, what="actor")
    assert_adam_weights_close(ref_critic, critic, lr=1e-3, steps=4, what="critic")
