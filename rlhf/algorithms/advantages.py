"""Advantage estimators as pure tensor functions (RL_MATH.md, "Advantage estimators").

No configs, groups or state: global statistics (for whitening across data-parallel ranks) are
passed in as arguments. Shapes: P prompts, N samples per prompt, B = P*N, T1 token positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def group_norm(rewards_PN: torch.Tensor) -> torch.Tensor:
    """GRPO: (R - mean_group) / (std_group + 1e-9); std is the unbiased sample std (n - 1)."""
    mean = rewards_PN.mean(-1, keepdim=True)
    std = rewards_PN.std(-1, keepdim=True)
    return (rewards_PN - mean) / (std + 1e-9)


def group_baseline(rewards_PN: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline and Dr.GRPO: R - mean_group(R)."""
    return rewards_PN - rewards_PN.mean(-1, keepdim=True)


@dataclass(frozen=True)
class Estimator:
    """A group step on sequence rewards, and whether token advantages are then whitened globally."""

    group_step: Callable[[torch.Tensor], torch.Tensor]
    whiten: bool


ESTIMATORS: dict[str, Estimator] = {
    "group_norm": Estimator(group_norm, whiten=False),
    "reinforce_baseline": Estimator(group_baseline, whiten=True),
}


def broadcast_to_tokens(scores_B: torch.Tensor, action_mask_BT1: torch.Tensor) -> torch.Tensor:
    """Per-token returns with gamma = 1 and the reward on the last action token: G_t = R on every action token."""
    return scores_B[:, None].to(action_mask_BT1.dtype) * action_mask_BT1


def masked_moments(x_BT1: torch.Tensor, mask_BT1: torch.Tensor) -> torch.Tensor:
    """Local [sum, sum of squares, count] of masked values, float64, for a global all-reduce."""
    x = x_BT1.double() * mask_BT1
    return torch.stack([x.sum(), (x * x_BT1.double()).sum(), mask_BT1.double().sum()])


def whiten(x_BT1: torch.Tensor, mask_BT1: torch.Tensor, moments: torch.Tensor, divide_std: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """Whiten masked values with global `moments` ([sum, sumsq, count] over every rank).

    Uses the biased (population) variance of all action tokens. Values outside the mask are 0.
    """
    total, total_sq, count = moments.tolist()
    mean = total / count
    out = x_BT1 - mean
    if divide_std:
        var = max(total_sq / count - mean * mean, 0.0)
        out = out / (var**0.5 + eps)
    return out * mask_BT1
