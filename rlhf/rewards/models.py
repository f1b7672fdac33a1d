"""Rewards from one or more reward models (scalar-head models), summed. Frozen; runs on the reward
role's ranks over their shard of the batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.models.micro_batches import MicroBatcher, forward_in_micro_batches
from rlhf.models.value import last_token_values, token_values
from rlhf.rewards.base import RewardInputs, RewardResult


class RewardModelEnsemble:
    """A `RewardSource` over scalar-head reward models, run in `batcher`'s micro-batches and layout."""

    collective = True  # ZeRO-3 gathers, ring attention and dynamic micro-batch counts span the role's ranks

    def __init__(self, models: Sequence[torch.nn.Module], device: torch.device, batcher: MicroBatcher,
                 norms: Sequence[tuple[float, float]] | None = None) -> None:
        """`norms`: each model's stored (mean, std), applied as (reward - mean) / std before the sum
        (--normalize_reward with models that carry them); None: raw rewards."""
        self.models, self.device, self.batcher = list(models), device, batcher
        self.norms = list(norms) if norms is not None else None
        assert self.norms is None or len(self.norms) == len(self.models)

    def _score_one(self, model: torch.nn.Module, batch: RewardInputs) -> torch.Tensor:
        return forward_in_micro_batches(
            lambda ids, mask: last_token_values(token_values(model, ids, mask, self.batcher.layout), mask),
            batch.sequences_BT, batch.attention_mask_BT, self.batcher, self.device)

    def score(self, batch: RewardInputs) -> RewardResult:
        per_model = [self._score_one(m, batch) for m in self.models]
        if self.norms is not None:
            per_model = [(r - mean) / std for r, (mean, std) in zip(per_model, self.norms)]
        rewards = torch.stack(per_model).sum(0)
        extra = {f"rm{i}": s for i, s in enumerate(per_model)} if len(per_model) > 1 else {}
        return RewardResult(rewards, rewards.clone(), extra)
