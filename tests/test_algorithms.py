"""Advantage estimators, whitening and the PPO-clip loss against hand-computed values."""

import math

import pytest
import torch

from rlhf.algorithms.advantages import (
    ESTIMATORS,
    broadcast_to_tokens,
    group_baseline,
    group_norm,
    masked_moments,
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


def test_estimator_table_whitening_flags():
    assert ESTIMATORS["group_norm"].whiten is False
    assert ESTIMATORS["reinforce_baseline"].whiten is True


def test_broadcast_to_tokens_puts_return_on_every_action_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
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
