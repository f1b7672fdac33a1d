"""Advantage estimators, whitening and the PPO-clip loss against hand-computed values."""

import math

import pytest
import torch

from rlhf.algorithms.advantages import (
    ESTIMATORS,
    discounted_returns,
    group_baseline,
    group_norm,
    masked_moments,
    token_rewards,
    whiten,
)
from rlhf.algorithms.losses import ppo_clip_loss_BT1, token_sum_over_global_count


def test_group_norm_hand_values():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.5*sqrt(3)
    out = group_norm(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    h = 0.5 * math.sqrt(3)
    torch.testing.assert_close(out[0], torch.tensor([h, -h, -h, h]))
    torch.testing.assert_close(out[1], torch.zeros(4))  # identical rewards: no signal, no NaN


def test_group_baseline_hand_values():
    out = group_baseline(torch.tensor([[3.0, 1.0], [0.0, 4.0]]))
    torch.testing.assert_close(out, torch.tensor([[1.0, -1.0], [-2.0, 2.0]]))


def test_undiscounted_return_puts_the_score_on_every_action_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    out = discounted_returns(token_rewards(torch.tensor([2.0, -1.0]), mask), mask, gamma=1.0)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, -1.0, -1.0]]))


def test_whiten_uses_global_moments_of_masked_tokens():
    x = torch.tensor([[9.0, 1.0, 3.0], [5.0, 100.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # masked values 1, 3, 5: mean 3, population variance 8/3
    moments = masked_moments(x, mask)
    torch.testing.assert_close(moments, torch.tensor([9.0, 35.0, 3.0], dtype=torch.float64))
    out = whiten(x, mask, moments)
    s = math.sqrt(8 / 3)
    torch.testing.assert_close(out, torch.tensor([[0.0, -2 / s, 0.0], [2 / s, 0.0, 0.0]]), atol=1e-6, rtol=0)
    centred = whiten(x, mask, moments, divide_std=False)
    torch.testing.assert_close(centred, torch.tensor([[0.0, -2.0, 0.0], [2.0, 0.0, 0.0]]))


def test_constant_groups_give_exactly_zero_advantages():
    """8 float32 rewards all 0.7 average to 0.7 - 6e-8: divided by their ~6e-8 std that residue was +0.921 (0.1:
    -0.831); every group estimator now gives exactly 0 for a constant group and leaves the others as they were."""
    from rlhf.algorithms.advantages import group_baseline, group_norm, leave_one_out

    rewards = torch.tensor([[0.7] * 8, [0.1] * 8, [0.0, 1.0] * 4])
    for estimator in (group_norm, group_baseline, leave_one_out):
        out = estimator(rewards)
        assert out[:2].abs().max().item() == 0.0, estimator.__name__
        assert out[2].abs().min().item() > 0.4, estimator.__name__  # the varied group keeps its advantages
    torch.testing.assert_close(group_norm(rewards)[2], torch.tensor([-1.0, 1.0] * 4) / (8 / 7) ** 0.5)


def test_whiten_floors_the_variance_of_a_near_constant_batch():
    """Float residue of +-6e-8 has variance 3.6e-15: (x - mean) / (std + 1e-8) made it +-0.86; OpenRLHF's
    (x - mean) / sqrt(max(var, 1e-8)) keeps it at +-6e-4."""
    x, mask = torch.tensor([[6e-8, -6e-8]]), torch.ones(1, 2)
    torch.testing.assert_close(whiten(x, mask, masked_moments(x, mask)), torch.tensor([[6e-4, -6e-4]]))


def test_whiten_split_moments_equal_whole():
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(6, 5, generator=g), (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = whiten(x, mask, masked_moments(x, mask))
    parts = masked_moments(x[:2], mask[:2]) + masked_moments(x[2:], mask[2:])
    torch.testing.assert_close(whiten(x[2:], mask[2:], parts), whole[2:])


def test_ppo_clip_loss_hand_values():
    # ratios e^0 = 1, e^0.5 = 1.6487, e^-0.5 = 0.6065 with eps 0.2
    logp = torch.tensor([[0.0, 0.5, -0.5, 0.5]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    loss, clipped = ppo_clip_loss_BT1(logp, old, adv, 0.2, 0.2)
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    expected = torch.tensor([[-1.0, -1.2, -r_lo, r_hi]])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(clipped, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_ppo_clip_asymmetric_range():
    loss, _ = ppo_clip_loss_BT1(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.tensor([[1.0]]), 0.2, 0.28)
    assert float(loss) == pytest.approx(-1.28)
    loss, _ = ppo_clip_loss_BT1(torch.tensor([[-0.5]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), 0.2, 0.28)
    assert float(loss) == pytest.approx(0.8)


def test_token_mean_uses_global_count():
    values = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    assert float(token_sum_over_global_count(values, mask, 8.0)) == pytest.approx(0.5)


def test_leave_one_out_hand_values():
    from rlhf.algorithms.advantages import leave_one_out

    # [1, 2, 6]: baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5
    torch.testing.assert_close(leave_one_out(torch.tensor([[1.0, 2.0, 6.0]])), torch.tensor([[-3.0, -1.5, 4.5]]))


def test_every_estimator_in_the_table():
    assert set(ESTIMATORS) == {"gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"}
    whitened = {k for k, e in ESTIMATORS.items() if e.whiten}
    assert whitened == {"gae", "reinforce", "reinforce_baseline"}
    assert {k for k, e in ESTIMATORS.items() if e.needs_critic} == {"gae"}
    grouped = {k for k, e in ESTIMATORS.items() if e.group_step is not None}
    assert grouped == {"reinforce_baseline", "rloo", "group_norm", "dr_grpo"}
    r = torch.tensor([[1.0, 3.0]])
    torch.testing.assert_close(ESTIMATORS["dr_grpo"].group_step(r), torch.tensor([[-1.0, 1.0]]))


def test_token_rewards_kl_and_score_on_last_action_token():
    from rlhf.algorithms.advantages import token_rewards

    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    kl = torch.tensor([[5.0, 0.1, 0.2, 0.3, 9.0], [1.0, 1.0, 0.5, 1.0, 1.0]])
    out = token_rewards(torch.tensor([2.0, -1.0]), mask, kl, kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.05, -0.1, 2.0 - 0.15, 0.0],
                                                  [0.0, 0.0, -1.0 - 0.25, 0.0, 0.0]]))


def test_discounted_returns_hand_values():
    from rlhf.algorithms.advantages import discounted_returns

    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    out = discounted_returns(rewards, mask, gamma=0.5)
    # G3 = 2, G2 = 0 + 0.5*2 = 1, G1 = 1 + 0.5*1 = 1.5
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.5, 1.0, 2.0, 0.0]]))


def test_gae_hand_values():
    from rlhf.algorithms.advantages import gae

    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.25, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lambd=0.8)
    # t=2: delta = 1 + 0 - 0.25 = 0.75 = A2; t=1: delta = 0 + 0.9*0.25 - 0.5 = -0.275; A1 = -0.275 + 0.72*0.75
    a1 = -0.275 + 0.9 * 0.8 * 0.75
    torch.testing.assert_close(adv, torch.tensor([[0.0, a1, 0.75, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, a1 + 0.5, 1.0, 0.0]]))


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    from rlhf.algorithms.advantages import discounted_returns, gae

    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    adv, _ = gae(rewards * mask, values, mask, gamma=0.7, lambd=1.0)
    torch.testing.assert_close(adv, (discounted_returns(rewards * mask, mask, 0.7) - values) * mask)


@pytest.mark.parametrize("kind,expected", [("k1", [0.5, -1.0, 10.0]), ("k2", [0.125, 0.5, 10.0]),
                                           ("k3", [math.exp(-0.5) - 0.5, math.e - 2, 10.0])])
def test_kl_estimators_hand_values(kind, expected):
    from rlhf.algorithms.kl import kl_estimate

    logp = torch.tensor([[0.5, -1.0, 20.0]])
    out = kl_estimate(logp, torch.zeros(1, 3), kind)
    torch.testing.assert_close(out, torch.tensor([expected]), rtol=1e-5, atol=1e-6)


def test_adaptive_kl_controller():
    from rlhf.algorithms.kl import KLController

    fixed = KLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    adaptive = KLController(0.1, target=1.0, horizon=1000)
    adaptive.update(5.0, 100)  # error clipped to 0.2: beta *= 1 + 0.2 * 0.1
    assert adaptive.value == pytest.approx(0.102)
    adaptive.update(0.9, 1000)  # error -0.1: beta *= 0.9
    assert adaptive.value == pytest.approx(0.0918)


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^2 = 7.39 with A = -1: PPO loss = max(7.39, 1.2) = 7.39; dual clip 3 caps it to 3
    loss, _ = ppo_clip_loss_BT1(torch.tensor([[2.0, 2.0]]), torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]),
                                0.2, 0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, -1.2]]))


def test_gspo_uses_one_ratio_per_sequence():
    from rlhf.algorithms.losses import gspo_loss_BT1

    logp = torch.tensor([[0.0, 0.1, -0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    loss, _ = gspo_loss_BT1(logp, torch.zeros(1, 4), torch.ones(1, 4), mask, 0.2, 0.2)
    torch.testing.assert_close(loss * mask, -mask)  # mean log-ratio 0 -> ratio 1 on both tokens


def test_log_ratio_is_clamped_before_exp():
    """Log-ratios (25, -25, 3, 21) with A = -1: per-token loss max(r, clip(r)); unclamped the mean is 1.8e10,
    clamped to +-20 it is (2 e^20 + 0.8 + e^3) / 4, and three of the four tokens count as clamped."""
    from rlhf.algorithms.losses import policy_token_loss_BT1

    logp, old, adv = torch.tensor([[25.0, -25.0, 3.0, 21.0]]), torch.zeros(1, 4), -torch.ones(1, 4)
    loss, _, clamped = policy_token_loss_BT1(logp, old, old, adv, torch.ones(1, 4), loss_type="ppo", clip_low=0.2,
                                             clip_high=0.2, dual_clip=None, is_correction=None)
    e20 = math.exp(20)
    torch.testing.assert_close(loss, torch.tensor([[e20, 0.8, math.exp(3), e20]]))
    assert float(loss.mean()) == pytest.approx((2 * e20 + 0.8 + math.exp(3)) / 4, rel=1e-6)
    assert clamped.tolist() == [[1.0, 1.0, 0.0, 1.0]]


def test_gspo_with_rollout_correction_takes_the_ratio_against_the_rollout_engine():
    """As OpenRLHF v0.9.5: with --enable_vllm_is_correction GSPO's sequence ratio is exp(mean(logp - logp_rollout))
    and no token weights apply. logp -1, rollout -1.1, old -1.5, A = 1: ratio e^0.1 = 1.10517 inside the clip, loss
    -1.10517 on both tokens (against the old policy with TIS weights it would be -1.2 x e^-0.4 = -0.804)."""
    from rlhf.algorithms.losses import policy_token_loss_BT1

    logp, old, rollout = torch.full((1, 2), -1.0), torch.full((1, 2), -1.5), torch.full((1, 2), -1.1)
    loss, _, _ = policy_token_loss_BT1(logp, old, rollout, torch.ones(1, 2), torch.ones(1, 2), loss_type="gspo",
                                       clip_low=0.2, clip_high=0.2, dual_clip=None, is_correction=(0.5, 5.0, "tis"))
    torch.testing.assert_close(loss, torch.full((1, 2), -math.exp(0.1)))
    ppo, _, _ = policy_token_loss_BT1(logp, old, rollout, torch.ones(1, 2), torch.ones(1, 2), loss_type="ppo",
                                      clip_low=0.2, clip_high=0.2, dual_clip=None, is_correction=(0.5, 5.0, "tis"))
    torch.testing.assert_close(ppo, torch.full((1, 2), -1.2 * math.exp(-0.4)))  # PPO keeps its TIS weights


def test_value_loss_hand_values():
    from rlhf.algorithms.losses import value_loss_BT1

    v, v_old, g = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    torch.testing.assert_close(value_loss_BT1(v, v_old, g, None), torch.tensor([[0.5, 2.0]]))
    # clipped V for token 0: 0 + clip(1, +-0.2) = 0.2 -> (0.2)^2 = 0.04 < 1: max keeps 1
    torch.testing.assert_close(value_loss_BT1(v, v_old, g, 0.2), torch.tensor([[0.5, 2.0]]))
    v2 = torch.tensor([[0.0, 1.0]])  # token 1: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24
    torch.testing.assert_close(value_loss_BT1(v2, v_old, g, 0.2), torch.tensor([[0.0, 1.62]]))


def test_importance_weights_tis_and_icepop():
    from rlhf.algorithms.losses import importance_weights_BT1

    old = torch.log(torch.tensor([[1.0, 3.0, 0.2]]))
    roll = torch.zeros(1, 3)
    tis, cut = importance_weights_BT1(old, roll, torch.ones(1, 3), 0.5, 2.0, "tis")
    torch.testing.assert_close(tis, torch.tensor([[1.0, 2.0, 0.5]]))
    icepop, cut_icepop = importance_weights_BT1(old, roll, torch.ones(1, 3), 0.5, 2.0, "icepop")
    torch.testing.assert_close(icepop, torch.tensor([[1.0, 0.0, 0.0]]))
    assert cut.tolist() == cut_icepop.tolist() == [[0.0, 1.0, 1.0]]


def test_seq_mask_tis_masks_whole_sequences_by_their_geometric_mean_ratio():
    """--vllm_is_correction_type seq-mask-tis, interval [0.5, 2], ratios r = exp(logp_old - logp_rollout).
    Sequence A, r = (3, 1/3): geometric mean sqrt(3 x 1/3) = 1 is inside, so its tokens keep their own ratios 3 and
    1/3, not truncated (TIS would give 2 and 0.5). Sequence B, r = (4, 2) and a padding token with r = 1/8:
    geometric mean over its action tokens sqrt(8) = 2.83 > 2, so every token gets weight 0 (with the padding token
    counted the mean would be (4 x 2 x 1/8)^(1/3) = 1, inside). With old = current policy and A = 1 the PPO token
    loss is -1, so the corrected loss is minus the weights."""
    from rlhf.algorithms.losses import importance_weights_BT1, policy_token_loss_BT1, rollout_mismatch_BT1

    ratios = torch.tensor([[3.0, 1 / 3, 1.0], [4.0, 2.0, 1 / 8]])
    action = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    roll = torch.full((2, 3), -1.0)
    old = roll + torch.log(ratios)
    weights, cut = importance_weights_BT1(old, roll, action, 0.5, 2.0, "seq-mask-tis")
    torch.testing.assert_close(weights, torch.tensor([[3.0, 1 / 3, 1.0], [0.0, 0.0, 0.0]]))
    assert cut.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    loss, _, _ = policy_token_loss_BT1(old, old, roll, torch.ones(2, 3), action, loss_type="ppo", clip_low=0.2,
                                       clip_high=0.2, dual_clip=None, is_correction=(0.5, 2.0, "seq-mask-tis"))
    torch.testing.assert_close(loss * action, torch.tensor([[-3.0, -1 / 3, 0.0], [0.0, 0.0, 0.0]]))
    metrics = rollout_mismatch_BT1(old, roll, action, (0.5, 2.0, "seq-mask-tis"))
    assert float((metrics["rollout/is_clipped_frac"] * action).sum() / action.sum()) == 0.5  # B's 2 of 4 tokens


def test_entropy_and_sequence_mean():
    from rlhf.algorithms.losses import sequence_mean_over_global_count
    from rlhf.models.lm_logprobs import logprobs_entropy

    _, ent = logprobs_entropy(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long))
    torch.testing.assert_close(ent, torch.full((1, 2), math.log(4)))
    values = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(sequence_mean_over_global_count(values, mask, 4.0)) == pytest.approx((2.0 + 2.0) / 4)


def test_length_penalties_and_group_filter():
    from rlhf.algorithms.shaping import group_filter, overlong_penalty, stop_properly_penalty

    out = overlong_penalty(torch.tensor([5, 7, 9, 12]), generate_max_len=10, buffer_len=4, factor=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.25, -0.75, -1.0]))
    r, trunc = torch.tensor([1.0, 1.0]), torch.tensor([True, False])
    torch.testing.assert_close(stop_properly_penalty(r, trunc, 0.5), torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(stop_properly_penalty(r, trunc, -0.5), torch.tensor([-0.5, 1.0]))
    keep = group_filter(torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), 0.0, 1.0)
    assert keep.tolist() == [False, True, False]


def test_running_moments_merge_equals_whole():
    from rlhf.algorithms.shaping import RunningMoments

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=g, dtype=torch.float64) * 3 + 1
    rm = RunningMoments()
    for part in (x[:20], x[20:]):
        rm.update(float(part.sum()), float((part * part).sum()), part.numel())
    assert rm.mean == pytest.approx(float(x.mean()))
    assert rm.std == pytest.approx(float(x.std(unbiased=False)))
