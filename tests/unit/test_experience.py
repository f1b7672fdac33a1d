"""What make-experience logs and feeds the KL controller, on hand-built batches: the KL over the samples
dynamic filtering keeps, returns (not advantages) for critic-free estimators, and the engine-vs-actor
log-prob mismatch with the off-policy correction's statistics."""

import math

import pytest
import torch

from rlhf.algorithms.advantages import ESTIMATORS
from rlhf.algorithms.kl import KLController
from rlhf.config.flags import parse_config
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.data.records import Rollout
from rlhf.trainers.experience import ExperienceMaker


def maker(*argv: str) -> ExperienceMaker:
    """An ExperienceMaker holding only its config-derived parts (the pure stages need nothing else)."""
    cfg = parse_config(TrainPPOConfig, list(argv))
    m = ExperienceMaker.__new__(ExperienceMaker)
    m.algo, m.rollout, m.schedule = cfg.algo, cfg.rollout, cfg.schedule
    m.estimator = ESTIMATORS[cfg.algo.advantage_estimator]
    m.kl_ctl = KLController(cfg.algo.init_kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
    return m


def rollout(action: torch.Tensor) -> Rollout:
    B, T1 = action.shape
    return Rollout(torch.zeros(B, T1 + 1, dtype=torch.long), torch.ones(B, T1 + 1, dtype=torch.long), action,
                   torch.zeros(B, T1), torch.ones(B, dtype=torch.long), action.sum(-1).long(), ["stop"] * B,
                   [""] * B, [""] * B)


def test_logged_kl_counts_only_the_groups_dynamic_filtering_keeps():
    m = maker("--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--dynamic_filtering")
    full = torch.ones(4, 2)
    kept = full * torch.tensor([1.0, 1.0, 0.0, 0.0])[:, None]  # the second prompt's group was filtered
    kl = torch.tensor([[0.1, 0.3], [0.4, 0.4], [5.0, 5.0], [5.0, 5.0]]) * kept
    metrics = m._metrics(rollout(full), torch.zeros(4), torch.zeros(4), {}, kl, kept)
    assert metrics["kl"] == pytest.approx((0.2 + 0.4) / 2)  # not (0.2 + 0.4 + 0 + 0) / 4
    assert metrics["kept_ratio"] == 0.5


def test_return_mean_of_a_critic_free_estimator_is_the_return():
    m = maker("--advantage_estimator", "reinforce", "--init_kl_coef", "0")
    action = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages, returns = m._advantages(torch.tensor([1.0, -2.0]), action, None, None, 1)
    # gamma 1: every action token's return is its sample's reward
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]]))
    assert float((advantages * action).sum()) == pytest.approx(0.0, abs=1e-6)  # whitened: mean 0


def test_rollout_mismatch_and_correction_statistics():
    m = maker("--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.5", "2.0")
    action = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    rollout_lp = torch.zeros(1, 4)
    old = torch.tensor([[math.log(3.0), math.log(0.25), 0.0, 9.0]])  # weights 3, 0.25, 1 (and a padding token)
    metrics = m._rollout_mismatch(old, rollout_lp, action)
    assert metrics["rollout/logprob_abs_diff"] == pytest.approx((math.log(3.0) + math.log(4.0)) / 3)
    assert metrics["rollout/is_weight_mean"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)  # TIS truncates
    assert metrics["rollout/is_clipped_frac"] == pytest.approx(2 / 3)
    icepop = maker("--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.5", "2.0",
                   "--vllm_is_correction_type", "icepop")._rollout_mismatch(old, rollout_lp, action)
    assert icepop["rollout/is_weight_mean"] == pytest.approx(1.0 / 3)  # ICEPOP zeroes the two outside
    assert set(maker()._rollout_mismatch(old, rollout_lp, action)) == {"rollout/logprob_abs_diff"}


def test_a_metric_without_a_declared_reduction_is_an_error():
    from rlhf.core.metrics import reduce_metrics
    from rlhf.distributed.topology import Role
    from rlhf.trainers.ppo_trainer import TRAIN_METRICS

    with pytest.raises(RuntimeError, match=r"actor produced metrics \['new_metric'\] with no declared reduction"):
        reduce_metrics({Role.ACTOR: {"policy_loss": 1.0, "new_metric": 2.0}}, TRAIN_METRICS, topology=None)


def test_experience_forwards_deal_rows_by_tokens_with_dynamic_batching(monkeypatch):
    """A role's replicas compute the rows `MicroBatcher.replica_rows` deals them with dynamic batching (even token
    totals), contiguous shards otherwise; reward functions (no batcher) keep contiguous shards."""
    from types import SimpleNamespace

    import rlhf.trainers.experience as experience
    from rlhf.distributed.topology import Role
    from rlhf.models.micro_batches import MicroBatcher

    lengths = [12, 3, 11, 2, 9, 4, 10, 1]
    mask = torch.tensor([[1] * n + [0] * (12 - n) for n in lengths])
    seen = []
    monkeypatch.setattr(experience, "assemble", lambda part, where, shape, group: seen.append(where) or part)
    rows = {}
    for rank in range(2):
        m = ExperienceMaker.__new__(ExperienceMaker)
        m.topology = SimpleNamespace(hosts=lambda role: True, replica_rank=lambda role: 0,
                                     dp_size=lambda role: 2, dp_rank=lambda role, r=rank: r, trainer_group=None)
        for name, balance in (("dynamic", (MicroBatcher(4, max_tokens=64), mask)), ("fixed", (MicroBatcher(4), mask)),
                              ("reward", None)):
            tokens = m._by_role(Role.ACTOR, lambda w: mask[w].sum(-1), (8,), balance=balance)
            rows[name, rank] = (seen[-1], tokens.tolist())
    assert [rows["dynamic", r][0].tolist() for r in range(2)] == [[0, 4, 5, 7], [1, 2, 3, 6]]
    assert [sum(rows["dynamic", r][1]) for r in range(2)] == [26, 26]  # contiguous shards: 28 and 24 tokens
    assert [rows["fixed", r][0] for r in range(2)] == [slice(0, 4), slice(4, 8)]
    assert [rows["reward", r][0] for r in range(2)] == [slice(0, 4), slice(4, 8)]
