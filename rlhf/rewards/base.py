"""The reward interface every reward source implements. Knows nothing about models or ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class RewardResult:
    """rewards_B: float32 [B] training rewards; scores_B: float32 [B] scores used for filtering
    (equal to the rewards unless the source says otherwise); extra_logs: name -> [B] values to log."""

    rewards_B: torch.Tensor
    scores_B: torch.Tensor
    extra_logs: dict[str, torch.Tensor] = field(default_factory=dict)


class RewardSource(Protocol):
    def score(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        """Score each query (prompt + response text). Called on the ranks that own the samples."""
        ...
