"""Policy losses as pure tensor functions (RL_MATH.md, "Losses").

Per-token losses are reduced with an explicit global normaliser (the number of action tokens of the
whole optimizer step over every micro-batch and DP rank), so any DP x accumulation split gives the
same gradient. Shapes: B samples, T1 token positions.
"""

from __future__ import annotations

import torch


def ppo_clip_loss_BT1(logprobs_BT1: torch.Tensor, old_logprobs_BT1: torch.Tensor, advantages_BT1: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss -min(rho*A, clip(rho, 1-lo, 1+hi)*A), and a 0/1 clipped indicator."""
    ratio = torch.exp(logprobs_BT1 - old_logprobs_BT1)
    unclipped = ratio * advantages_BT1
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages_BT1
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()


def token_sum_over_global_count(values_BT1: torch.Tensor, mask_BT1: torch.Tensor,
                                global_num_tokens: float) -> torch.Tensor:
    """Sum of masked per-token values divided by the global token count of the optimizer step."""
    return (values_BT1 * mask_BT1).sum() / global_num_tokens
