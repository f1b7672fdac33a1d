"""Advantage estimators as pure tensor functions (RL_MATH.md, "Advantage estimators").

No configs, groups or state: global statistics (for whitening across data-parallel ranks) are
passed in as arguments. Shapes: P prompts, N samples per prompt, B = P*N, T1 token positions
aligned with next-token targets (see rlhf.data.records); masks are float 0/1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _zero_where_constant(rewards_PN: torch.Tensor, advantages_PN: torch.Tensor) -> torch.Tensor:
    """Exactly 0 for a group whose rewards are all equal: its mean carries float rounding (8 x 0.7 in float32
    averages to 0.7 - 6e-8), which a division by the group's std, or later whitening, would blow up to O(1)."""
    constant = (rewards_PN == rewards_PN[..., :1]).all(-1, keepdim=True)
    return torch.where(constant, torch.zeros_like(advantages_PN), advantages_PN)


def group_norm(rewards_PN: torch.Tensor) -> torch.Tensor:
    """GRPO: (R - mean_group) / (std_group + 1e-9); std is the unbiased sample std (n - 1); 0 for a constant group."""
    mean = rewards_PN.mean(-1, keepdim=True)
    std = rewards_PN.std(-1, keepdim=True)
    return _zero_where_constant(rewards_PN, (rewards_PN - mean) / (std + 1e-9))


def group_baseline(rewards_PN: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline and Dr.GRPO: R - mean_group(R); 0 for a constant group."""
    return _zero_where_constant(rewards_PN, rewards_PN - rewards_PN.mean(-1, keepdim=True))


def leave_one_out(rewards_PN: torch.Tensor) -> torch.Tensor:
    """RLOO: R - (sum_group R - R) / (n - 1); 0 for a constant group."""
    n = rewards_PN.shape[-1]
    return _zero_where_constant(rewards_PN, rewards_PN - (rewards_PN.sum(-1, keepdim=True) - rewards_PN) / (n - 1))


@dataclass(frozen=True)
class Estimator:
    """How one `--advantage_estimator` turns rewards into token advantages.

    group_step: applied to sequence rewards [P, N] before returns (None: no group step).
    whiten: whiten token advantages with global statistics afterwards.
    needs_critic: uses value estimates (GAE).
    gamma_one: discounting is switched off (group methods).
    """

    group_step: Callable[[torch.Tensor], torch.Tensor] | None
    whiten: bool
    needs_critic: bool = False
    gamma_one: bool = True


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(None, whiten=True, needs_critic=True, gamma_one=False),
    "reinforce": Estimator(None, whiten=True, gamma_one=False),
    "reinforce_baseline": Estimator(group_baseline, whiten=True),
    "rloo": Estimator(leave_one_out, whiten=False),
    "group_norm": Estimator(group_norm, whiten=False),
    "dr_grpo": Estimator(group_baseline, whiten=False),
}


def last_action_index(action_mask_BT1: torch.Tensor) -> torch.Tensor:
    """int64 [B]: position of the last action token of each row (rows must have one)."""
    positions = torch.arange(action_mask_BT1.shape[1], device=action_mask_BT1.device)
    return (positions * (action_mask_BT1 > 0)).argmax(-1)


def token_rewards(scores_B: torch.Tensor, action_mask_BT1: torch.Tensor, kl_BT1: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """r_t = -kl_coef * kl_t on action tokens, plus the sequence score on the last action token."""
    rewards = torch.zeros_like(action_mask_BT1, dtype=torch.float32)
    if kl_BT1 is not None and kl_coef != 0.0:
        rewards = -kl_coef * kl_BT1.float() * action_mask_BT1
    last = last_action_index(action_mask_BT1)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores_B.float()
    return rewards


def discounted_returns(rewards_BT1: torch.Tensor, action_mask_BT1: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k>=t} gamma^(k-t) r_k over action tokens (0 elsewhere). Non-action tokens between action
    spans (an agent's environment text) are skipped, not steps: a later turn's reward reaches earlier turns,
    as in `gae`."""
    returns = torch.zeros_like(rewards_BT1)
    running = torch.zeros_like(rewards_BT1[:, 0])
    for t in reversed(range(rewards_BT1.shape[1])):
        m = action_mask_BT1[:, t]
        running = torch.where(m > 0, rewards_BT1[:, t] + gamma * running, running)
        returns[:, t] = running * m
    return returns


def gae(rewards_BT1: torch.Tensor, values_BT1: torch.Tensor, action_mask_BT1: torch.Tensor, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over action tokens: (advantages, returns = advantages + values).

    delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last action token;
    A_t = delta_t + gamma lambda A_{t+1}.
    """
    values = values_BT1.float() * action_mask_BT1
    advantages = torch.zeros_like(rewards_BT1)
    next_value = torch.zeros_like(rewards_BT1[:, 0])
    next_adv = torch.zeros_like(rewards_BT1[:, 0])
    for t in reversed(range(rewards_BT1.shape[1])):
        m = action_mask_BT1[:, t]
        delta = rewards_BT1[:, t] + gamma * next_value - values[:, t]
        adv = (delta + gamma * lambd * next_adv) * m
        advantages[:, t] = adv
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv, next_adv)
    return advantages, (advantages + values) * action_mask_BT1


def masked_moments(x_BT1: torch.Tensor, mask_BT1: torch.Tensor) -> torch.Tensor:
    """Local [sum, sum of squares, count] of masked values, float64, for a global all-reduce."""
    x = x_BT1.double() * mask_BT1
    return torch.stack([x.sum(), (x * x_BT1.double()).sum(), mask_BT1.double().sum()])


def whiten(x_BT1: torch.Tensor, mask_BT1: torch.Tensor, moments: torch.Tensor, divide_std: bool = True,
           min_var: float = 1e-8) -> torch.Tensor:
    """Whiten masked values with global `moments` ([sum, sumsq, count] over every rank).

    Uses the biased (population) variance of all action tokens, floored at `min_var` (OpenRLHF's
    (x - mean) / sqrt(max(var, 1e-8)): a near-constant batch keeps its tiny spread instead of being scaled up
    to +-1). Values outside the mask are 0.
    """
    total, total_sq, count = moments.tolist()
    mean = total / max(count, 1.0)
    out = x_BT1 - mean
    if divide_std:
        var = max(total_sq / max(count, 1.0) - mean * mean, min_var)
        out = out / var**0.5
    return out * mask_BT1
