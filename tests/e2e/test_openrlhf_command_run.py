"""The hybrid-engine PPO command of OpenRLHF v0.9.5's example scripts, replayed with every flag verbatim except model
and data paths and sizes, trains at tiny scale on 2 CPU ranks, with the values that follow from its flags. (The ranks
are forks of the tests' preloaded server, `run_job_variants`: the command's flags are what is under test; torchrun
and the product's launcher have tests of their own.)"""


import pytest

from tests.distributed import run_job_variants
from tests.openrlhf_commands import PPO_HYBRID_ENGINE, at_tiny_scale
from tests.tiny_runs import read_metrics


@pytest.mark.vllm
def test_openrlhf_hybrid_engine_ppo_command_trains_at_tiny_scale(tmp_path):
    pytest.importorskip("vllm")
    argv = at_tiny_scale(PPO_HYBRID_ENGINE, tmp_path)
    (console,) = run_job_variants(2, [("train_ppo", [*argv, "--max_steps", "2"])], tmp_path / "console",
                                  tmp_path / "save")
    assert "algorithm: --advantage_estimator gae, 1 sample per prompt, KL k1 x 0.01 (fixed) in the reward" \
        in console
    assert ", generation: vLLM (installed)\n" in console
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
