"""Rewards from a process reward model (trained by `train_prm`): the probability of the positive reward token
at each placeholder token (one after each step of an answer), reduced over the steps to one reward per
sample (the minimum by default: an answer is as good as its worst step). Inference only; one process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.models.layout import position_ids_for
from rlhf.rewards.base import RewardInputs, RewardResult

PRM_REDUCTIONS = {"min": lambda s: s.min(), "mean": lambda s: s.mean(), "last": lambda s: s[-1]}


class ProcessRewardSource:
    """A `RewardSource` over a causal LM trained as a process reward model. `reward_token_ids`: the positive
    token first (its probability, against the other reward tokens, is a step's score)."""

    collective = False

    def __init__(self, model: torch.nn.Module, device: torch.device, placeholder_id: int,
                 reward_token_ids: Sequence[int], reduction: str = "min", batch_size: int = 16) -> None:
        if reduction not in PRM_REDUCTIONS:
            raise ValueError(f"--prm_reduction {reduction!r}: choose one of {', '.join(PRM_REDUCTIONS)}")
        if len(reward_token_ids) < 2:
            raise ValueError("a process reward model needs at least two --reward_tokens, the positive one first")
        self.model, self.device, self.placeholder_id = model, device, placeholder_id
        self.reward_ids = torch.tensor(list(reward_token_ids))
        self.reduce, self.reduction, self.batch_size = PRM_REDUCTIONS[reduction], reduction, batch_size

    @torch.no_grad()
    def step_scores(self, batch: RewardInputs) -> list[torch.Tensor]:
        """Per sample, float32 [steps]: P(positive token) at each placeholder, in order."""
        out: list[torch.Tensor] = []
        for start in range(0, len(batch.queries), self.batch_size):
            ids = batch.sequences_BT[start:start + self.batch_size].to(self.device)
            mask = batch.attention_mask_BT[start:start + self.batch_size].to(self.device)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask),
                                use_cache=False).logits
            probs = logits.index_select(-1, self.reward_ids.to(logits.device)).float().softmax(-1)[..., 0]
            at = (ids == self.placeholder_id) & mask.bool()
            out.extend(probs[i][at[i]].cpu() for i in range(ids.shape[0]))
        return out

    def score(self, batch: RewardInputs) -> RewardResult:
        steps = self.step_scores(batch)
        empty = [i for i, s in enumerate(steps) if s.numel() == 0]
        if empty:
            raise ValueError(f"{len(empty)} of {len(steps)} queries (first: #{empty[0]}) contain no placeholder "
                             "token; put the --placeholder_token after each step")
        rewards = torch.stack([self.reduce(s) for s in steps]).float()
        return RewardResult(rewards, rewards.clone(), {"prm_steps": torch.tensor([float(len(s)) for s in steps])})
