"""End-to-end runs of `train_ppo` on the embedded tiny demo, through torchrun."""

import os
import subprocess

import pytest
import torch

from tests.distributed import ROOT, run_torchrun
from tests.tiny_runs import SMALL, read_metrics

REQUIRED_KEYS = {"step", "reward_mean", "time/generation", "time/weight_sync", "time/experience", "time/train",
                 "time/step", "policy_loss", "grad_norm", "lr", "response_length"}
def check_outputs(out_dir, steps):
    from transformers import AutoModelForCausalLM

    rows = read_metrics(out_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert REQUIRED_KEYS <= set(row), REQUIRED_KEYS - set(row)
        assert 0.0 <= row["reward_mean"] <= 1.0 and row["time/step"] > 0
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "model"))
    assert sum(p.numel() for p in model.parameters()) > 0
    return rows


@pytest.mark.vllm
def test_two_rank_vllm_zero3_reinforce_baseline(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "run"
    proc = run_torchrun(2, "-m rlhf.cli.train_ppo", *SMALL, "--zero_stage", "3",
                        "--advantage_estimator", "reinforce_baseline", "--save_path", str(out),
                        "--use_tensorboard", str(tmp_path / "tb"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    check_outputs(out, 3)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    # the saved model differs from the starting one: training happened and was gathered from ZeRO-3 shards
    from transformers import AutoModelForCausalLM

    from rlhf.assets import EMBEDDED_MODEL_DIR

    before = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4


def test_hf_fallback_engine_single_rank(tmp_path):
    out = tmp_path / "run"
    proc = run_torchrun(1, "-m rlhf.cli.train_ppo", *SMALL, "--rollout_engine", "hf", "--save_path", str(out),
                        "--zero_stage", "0")
    assert proc.returncode == 0, proc.stderr[-6000:]
    check_outputs(out, 3)


@pytest.mark.vllm
def test_quickstart_learns(tmp_path):
    """The README's quickstart: GRPO on the copy task must clearly raise the reward."""
    pytest.importorskip("vllm")
    out = tmp_path / "quick"
    proc = subprocess.run(["bash", "launch/quickstart.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-6000:]
    rewards = [r["reward_mean"] for r in read_metrics(out)]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    print(f"reward_mean first fifth {first:.3f}, last fifth {last:.3f}")
    assert last > first + 0.3, (first, last)
    assert torch.isfinite(torch.tensor(rewards)).all()


@pytest.mark.vllm
def test_every_stabiliser_wired_through(tmp_path):
    """RLOO + GSPO with KL loss, entropy bonus, ptx loss, ICEPOP correction, dynamic filtering, length
    penalties, reward normalisation and clipping run together, and each reports its metric."""
    pytest.importorskip("vllm")
    from rlhf.assets import TINY_DIR

    out = tmp_path / "run"
    proc = run_torchrun(2, "-m rlhf.cli.train_ppo", *SMALL, "--advantage_estimator", "rloo", "--use_kl_loss",
                        "--kl_estimator", "k3", "--init_kl_coef", "0.01", "--policy_loss_type", "gspo",
                        "--entropy_loss_coef", "0.01", "--ptx_coef", "0.1", "--pretrain_data",
                        f"{TINY_DIR}/prompts.jsonl", "--enable_vllm_is_correction", "--use_icepop",
                        "--dynamic_filtering", "--dynamic_filtering_reward_range", "-0.01", "0.99",
                        "--overlong_buffer_len", "2", "--stop_properly_penalty_coef", "0.5", "--normalize_reward",
                        "--reward_clip_range", "-2", "2", "--save_path", str(out))
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = check_outputs(out, 3)
    for row in rows:
        assert row["entropy"] > 0 and row["ptx_loss"] > 0 and row["kl"] >= 0
        assert 0.0 <= row["kept_ratio"] <= 1.0
        assert -2.0 <= row["reward_shaped_mean"] <= 2.0


@pytest.mark.vllm
def test_critic_warmup_freezes_the_actor_and_adaptive_kl_moves(tmp_path):
    pytest.importorskip("vllm")
    from rlhf.assets import TINY_DIR

    out = tmp_path / "run"
    proc = run_torchrun(2, "-m rlhf.cli.train_ppo", *SMALL, "--advantage_estimator", "gae",
                        "--n_samples_per_prompt", "1", "--rollout_batch_size", "8",
                        "--reward_pretrain", f"{TINY_DIR}/reward_model", "--freezing_actor_steps", "2",
                        "--value_clip", "0.2", "--dual_clip", "3", "--init_kl_coef", "0.05",
                        "--kl_target", "0.001", "--kl_horizon", "100",
                        "--save_path", str(out))
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_metrics(out)
    assert [("policy_loss" in r) for r in rows] == [False, False, True]
    assert all(r["value_loss"] > 0 for r in rows)
    assert rows[0]["kl_coef"] == 0.05 and rows[2]["kl_coef"] != rows[1]["kl_coef"]
    assert os.path.isfile(out / "critic" / "model.safetensors")
