"""Typed records passed between stages of one RL step.

Shape legend used across the package: B = samples in a batch, T = sequence positions (prompt +
response, right-padded), T1 = T - 1 next-token positions (index t scores token t + 1), P = prompts,
N = samples per prompt, V = vocabulary. Log-prob tensors are float32 and aligned with
`sequences_BT[:, 1:]`; `action_mask_BT1` is 1 exactly where that target token was generated
(EOS included) and 0 on prompt and padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

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
    """The step's samples with everything the losses need (global batch, identical on every rank).

    action_mask_BT1: float32 [B, T-1] action tokens that count in the losses (filtered groups are 0).
    old_logprobs_BT1 / rollout_logprobs_BT1 / ref_logprobs_BT1: float32 [B, T-1] actor at experience
        time / rollout engine / reference model (None without a reference model).
    values_BT1, returns_BT1: float32 [B, T-1] critic values and returns (None without a critic).
    advantages_BT1: float32 [B, T-1]; rewards_B: float32 [B] shaped sequence rewards.
    """

    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT1: torch.Tensor
    old_logprobs_BT1: torch.Tensor
    rollout_logprobs_BT1: torch.Tensor
    advantages_BT1: torch.Tensor
    rewards_B: torch.Tensor
    ref_logprobs_BT1: torch.Tensor | None = None
    values_BT1: torch.Tensor | None = None
    returns_BT1: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return self.sequences_BT.shape[0]

    def select(self, index: torch.Tensor | slice) -> Experience:
        """The samples at `index` (all tensor fields)."""
        return Experience(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                             for f in fields(self)})

    def slice(self, start: int, stop: int) -> Experience:
        """Samples [start, stop), trimmed to the longest real sequence among them."""
        return self.select(slice(start, stop)).trimmed()

    def trimmed(self) -> Experience:
        """The same samples without the columns that are padding in every row."""
        part = self
        length = int(part.attention_mask_BT.sum(-1).max())
        width = part.sequences_BT.shape[1]

        def trim(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.dim() < 2:
                return t
            return t[:, :length] if t.shape[1] == width else t[:, : length - 1]

        return Experience(**{f.name: trim(getattr(part, f.name)) for f in fields(part)})
