"""A split placement (actor+ref on ranks 0-1, critic+reward on ranks 2-3) gives the same losses and
weights after two PPO steps as every role colocated on all 4 ranks, at ZeRO-3 (whose collectives had to be scoped
to a role's group; ZeRO-0 to 2 on subgroups need no patch).

Tolerance: the two runs differ only in how the same global batch is split over DP ranks and
micro-batches (4 ranks x 1 micro-batch vs 2 ranks x 2), i.e. in fp32 summation order (~1e-7
relative). The metrics agree to rel 1e-4; the weights as `tests.tiny_runs.assert_adam_weights_close` derives
(AdamW turns a rounding difference in a gradient within ~1e-8 of zero into a move of up to lr: one such weight
differed by more than 1e-5 on one machine and not on another). Step 2 samples from engines loaded with these
weights.
"""

import json
import os

import pytest
from safetensors.torch import load_file

from rlhf.assets import TINY_DIR
from tests.distributed import run_job_variants
from tests.tiny_runs import EAGER, TRAIN, assert_adam_weights_close

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

COMMON = [*TRAIN, *EAGER, "--pretrain", f"{TINY_DIR}/policy", "--reward_pretrain", f"{TINY_DIR}/reward_model",
          "--prompt_data", f"{TINY_DIR}/prompts.jsonl", "--advantage_estimator", "gae", "--init_kl_coef", "0.01",
          "--n_samples_per_prompt", "1", "--rollout_batch_size", "8", "--micro_rollout_batch_size", "4",
          "--train_batch_size", "8", "--micro_train_batch_size", "2", "--generate_max_len", "6",
          "--prompt_max_len", "16", "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3",
          "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--max_steps", "2", "--seed", "3"]
SPLIT = ["--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "2",
         "--reward_num_gpus_per_node", "2", "--colocate_actor_ref", "--colocate_critic_reward"]


def results(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    return metrics, load_file(os.path.join(out, "model", "model.safetensors")), \
        load_file(os.path.join(out, "critic", "model.safetensors"))


def test_split_placement_equals_colocated(tmp_path):
    """Both placements in one 4-rank launch (`run_job_variants`), colocated first."""
    zero_stage = 3  # the stage whose collectives DeepSpeed had to be taught to scope to a role's group
    runs = {"colocated": ["--colocate_all_models"], "split": SPLIT}
    run_job_variants(4, [("train_ppo", [*COMMON, *placement, "--zero_stage", str(zero_stage),
                                        "--save_path", str(tmp_path / name)]) for name, placement in runs.items()],
                     tmp_path / "consoles", *(tmp_path / name for name in runs))
    colo_metrics, colo_actor, colo_critic = results(tmp_path / "colocated")
    split_metrics, split_actor, split_critic = results(tmp_path / "split")
    assert len(colo_metrics) == len(split_metrics) == 2
    for a, b in zip(colo_metrics, split_metrics):
        for key in ("reward_mean", "response_length", "kl", "policy_loss", "value_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])
    initial = load_file(os.path.join(TINY_DIR, "policy", "model.safetensors"))
    assert max(float((colo_actor[k] - initial[k]).abs().max()) for k in initial) > 5e-4
    assert_adam_weights_close(colo_actor, split_actor, lr=1e-3, steps=2, what="actor")
    assert_adam_weights_close(colo_critic, split_critic, lr=1e-3, steps=2, what="critic")
