"""Rewards from one or more reward models (scalar-head models), summed. Frozen; runs on the reward
role's ranks over their shard of the batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.models.value import last_token_values
from rlhf.rewards.base import RewardInputs, RewardResult


class RewardModelEnsemble:
    """A `RewardSource` over reward models given as callables values_BT = model(ids, mask)."""

    def __init__(self, models: Sequence[torch.nn.Module], device: torch.device, micro_batch_size: int) -> None:
        self.models, self.device, self.micro_batch_size = list(models), device, micro_batch_size

    @torch.no_grad()
    def _score_one(self, model: torch.nn.Module, batch: RewardInputs) -> torch.Tensor:
        out = []
        for start in range(0, batch.sequences_BT.shape[0], self.micro_batch_size):
            ids = batch.sequences_BT[start:start + self.micro_batch_size].to(self.device)
            mask = batch.attention_mask_BT[start:start + self.micro_batch_size].to(self.device)
            out.append(last_token_values(model(ids, mask), mask).float().cpu())
        return torch.cat(out)

    def score(self, batch: RewardInputs) -> RewardResult:
        per_model = [self._score_one(m, batch) for m in self.models]
        rewards = torch.stack(per_model).sum(0)
        extra = {f"rm{i}": s for i, s in enumerate(per_model)} if len(per_model) > 1 else {}
        return RewardResult(rewards, rewards.clone(), extra)
