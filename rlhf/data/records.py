"""Typed records passed between stages of one RL step.

Shape legend used across the package: B = samples in a batch, T = sequence positions (prompt +
response, right-padded), T1 = T - 1 next-token positions (index t scores token t + 1), P = prompts,
N = samples per prompt, V = vocabulary. Log-prob tensors are float32 and aligned with
`sequences_BT[:, 1:]`; `action_mask_BT1` is 1 exactly where that target token was generated
(EOS included) and 0 on prompt and padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    """Samples produced by a rollout engine on this rank; samples of one prompt are contiguous.

    sequences_BT: int64 [B, T] prompt then response tokens, right-padded with the pad id.
    attention_mask_BT: int64 [B, T] 1 on real tokens.
    action_mask_BT1: float32 [B, T-1] 1 on generated target positions.
    rollout_logprobs_BT1: float32 [B, T-1] engine log-probs of generated tokens (0 elsewhere).
    """

    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT1: torch.Tensor
    rollout_logprobs_BT1: torch.Tensor
    prompt_lens_B: torch.Tensor
    response_lens_B: torch.Tensor
    finish_reasons: list[str]
    prompts: list[str]
    responses: list[str]
    labels: list = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return self.sequences_BT.shape[0]


@dataclass
class Experience:
    """One sample batch ready for the policy loss (all tensors on the training device).

    old_logprobs_BT1: float32 [B, T-1] actor log-probs at experience time.
    advantages_BT1: float32 [B, T-1] per-token advantages (0 outside the action mask).
    rewards_B: float32 [B] scalar reward of each sample.
    """

    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT1: torch.Tensor
    old_logprobs_BT1: torch.Tensor
    advantages_BT1: torch.Tensor
    rewards_B: torch.Tensor

    @property
    def num_samples(self) -> int:
        return self.sequences_BT.shape[0]

    def slice(self, start: int, stop: int) -> Experience:
        """Samples [start, stop), trimmed to the longest real sequence among them."""
        length = int(self.attention_mask_BT[start:stop].sum(-1).max())
        return Experience(
            sequences_BT=self.sequences_BT[start:stop, :length],
            attention_mask_BT=self.attention_mask_BT[start:stop, :length],
            action_mask_BT1=self.action_mask_BT1[start:stop, : length - 1],
            old_logprobs_BT1=self.old_logprobs_BT1[start:stop, : length - 1],
            advantages_BT1=self.advantages_BT1[start:stop, : length - 1],
            rewards_B=self.rewards_B[start:stop],
        )
