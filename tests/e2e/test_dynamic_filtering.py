"""--dynamic_filtering end to end: with refills every step trains on a full batch of informative groups, each
sample scored once (a random reward is judged and trained on with the same value); capped at one round, rejected
groups are masked (the old behaviour)."""

import pytest
import torch

from rlhf.assets import EMBEDDED_PROMPTS
from tests.distributed import run_job_variants
from tests.tiny_runs import SMALL, read_metrics


def _run(out, *extra) -> tuple[str, list[str]]:
    return "train_ppo", [*SMALL, "--rollout_engine", "hf", "--zero_stage", "0", "--prompt_data", EMBEDDED_PROMPTS,
                         "--dynamic_filtering", "--seed", "2", "--save_path", str(out), *extra]


RANDOM_COUNTING_REWARD = """
import os, random, torch

def reward_func(queries, prompts, labels):
    rewards = torch.tensor([float(random.random() < 0.2) for _ in queries])
    with open(os.path.join(os.path.dirname(__file__), "calls.txt"), "a") as f:
        f.write(f"{len(queries)} {float(rewards.sum())}\\n")
    return {"rewards": rewards, "extra_logs": {"call_mean": rewards.mean(), "per_sample": rewards}}
"""
"""1 with probability 0.2: 41% of groups of 4 are all 0 (not informative). Scored twice, a kept group would be
rejected by the second score in 41% of cases; each call's size and reward sum are appended to calls.txt beside
the file. Extra logs: the call's mean reward (one value per call) and each sample's reward."""


def test_every_step_trains_on_a_full_batch_of_informative_groups(tmp_path):
    reward = tmp_path / "random_reward.py"
    reward.write_text(RANDOM_COUNTING_REWARD)
    out, _ = run_job_variants(1, [
        _run(tmp_path / "refill", "--dynamic_filtering_max_rounds", "50", "--remote_rm_url", str(reward)),
        _run(tmp_path / "one_round", "--dynamic_filtering_max_rounds", "1")], tmp_path / "consoles")
    rows, capped = read_metrics(tmp_path / "refill"), read_metrics(tmp_path / "one_round")
    calls = [tuple(map(float, line.split())) for line in (tmp_path / "calls.txt").read_text().splitlines()]
    assert sum(n for n, _ in calls) == sum(r["dynamic_filtering_prompts"] for r in rows) * 4  # each scored once
    for r in rows:
        assert r["kept_ratio"] == 1.0  # all 4 groups of every step are informative, by the scores trained on
        drawn = r["dynamic_filtering_prompts"]
        assert drawn >= 4 and r["dynamic_filtering_pass_rate"] >= 100 * 4 / drawn - 1e-9
        assert 0 < r["reward_mean"] < 1
        # a per-sample extra log is the kept samples' mean; a per-call one the mean over every sample scored
        assert r["reward_extra/per_sample"] == pytest.approx(r["reward_mean"])
        step_calls, scored = [], 0
        while scored < drawn * 4:
            step_calls.append(calls.pop(0))
            scored += step_calls[-1][0]
        assert r["reward_extra/call_mean"] == pytest.approx(sum(s for _, s in step_calls) / scored)
    assert out.count("extra_logs['call_mean'] as one value per call") == 1
    assert any(r["dynamic_filtering_rounds"] > 1 for r in rows)  # the demo's uniform groups needed refills

    for r in capped:  # one round: the old behaviour, rejected groups masked
        assert r["dynamic_filtering_rounds"] == 1 and r["dynamic_filtering_prompts"] == 4
        assert r["dynamic_filtering_pass_rate"] == pytest.approx(100 * r["kept_ratio"])
    assert any(r["kept_ratio"] < 1 for r in capped)
    assert torch.tensor([r["kept_ratio"] for r in capped]).mean() < 1
